"""Small things a newcomer trips on (issue 48): each fails on the code before it, each in every door it concerns."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import phase_timer


def _model_opt():  # noqa: ANN202
    m = nn.Linear(4, 4)
    return m, torch.optim.SGD(m.parameters(), 0.1)


@pytest.mark.parametrize("door", ["attach", "PhaseTimer", "PhaseTimerCallback"])
def test_an_empty_log_dir_fails_naming_it(door) -> None:
    m, o = _model_opt()
    make = {"attach": lambda: phase_timer.attach(m, o, log_dir=""), "PhaseTimer": lambda: phase_timer.PhaseTimer(log_dir=""),
            "PhaseTimerCallback": lambda: phase_timer.PhaseTimerCallback(log_dir="")}[door]
    with pytest.raises(ValueError, match=rf"^{door}\(log_dir=''\): `log_dir` must be .*empty"):
        make()


@pytest.mark.parametrize("door, wrong, right", [
    ("attach", "log_every_n_steps", "window"), ("PhaseTimerCallback", "log_every_n_steps", "window"),
    ("PhaseTimer", "window", "log_every_n_steps"),
])
def test_another_doors_name_for_the_window_says_this_doors(door, wrong, right) -> None:
    m, o = _model_opt()
    make = {"attach": lambda **kw: phase_timer.attach(m, o, **kw), "PhaseTimer": phase_timer.PhaseTimer,
            "PhaseTimerCallback": phase_timer.PhaseTimerCallback}[door]
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{wrong}': {door}'s is `{right}=`"):
        make(**{wrong: 10})
    with pytest.raises(TypeError, match=r"'warmup': did you mean `warmup_steps=`\?"):
        make(warmup=3)


def test_a_swapped_model_and_optimizer_say_so_once() -> None:
    m, o = _model_opt()
    with pytest.raises(ValueError) as err:
        phase_timer.attach(o, m)
    text = str(err.value)
    assert "swapped" in text and "Parameter Group" not in text and "\n" not in text  # its repr was there twice


def test_the_loader_iterated_after_close_says_it_is_not_timed(tmp_path) -> None:
    m, o = _model_opt()
    timer = phase_timer.attach(m, o, [torch.randn(2, 4)] * 3, log_dir=tmp_path, summary=False)
    for x in timer.loader:
        m(x).sum().backward()
        o.step()
    timer.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert len(list(timer.loader)) == 3  # the batches still come
    assert [w for w in seen if "iterated after the timer was closed" in str(w.message)]


def test_a_cpu_run_says_how_to_get_mfu(tmp_path) -> None:
    m, o = _model_opt()
    with phase_timer.attach(m, o, [torch.randn(2, 4)] * 30, log_dir=tmp_path, warmup_steps=2) as timer:
        for x in timer.loader:
            m(x).sum().backward()
            o.step()
    assert "MFU: not measured on the host clock" in timer.last_summary and "peak_tflops=" in timer.last_summary
    with phase_timer.attach(m, o, [torch.randn(2, 4)] * 30, log_dir=tmp_path, warmup_steps=2, mfu=False) as off:
        for x in off.loader:
            m(x).sum().backward()
            o.step()
    assert "MFU" not in off.last_summary  # turned off: nothing to say


def _run(tmp_path):  # noqa: ANN001, ANN202
    m, o = _model_opt()
    with phase_timer.attach(m, o, [torch.randn(2, 4)] * 30, log_dir=tmp_path, warmup_steps=2, window=5,
                            summary=False) as timer:
        for x in timer.loader:
            m(x).sum().backward()
            o.step()
    return timer


def test_report_from_the_windows_does_not_say_the_summary_file_is_missing(tmp_path, capsys) -> None:
    from phase_timer.cli import main

    timer = _run(tmp_path)
    assert main(["report", timer.log_dir, "--source", "window"]) == 0
    out = capsys.readouterr().out
    assert "from TensorBoard's throughput/* scalars" in out and "no phase_timer_summary.json" not in out


def test_compares_last_column_has_a_header(tmp_path, capsys) -> None:
    from phase_timer.cli import main

    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    assert main(["compare", a.log_dir, b.log_dir]) == 0
    head = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("phase "))
    assert head.split()[-1] == "verdict"
