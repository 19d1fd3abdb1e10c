"""``phase-timer compare``: the regression gate, on real runs of a plain-PyTorch loop (CPU).

Every number comes from a run: a loop whose phases take known amounts of time, timed
by the plain door into real TensorBoard files and a real summary file.  "Noisy" runs add
a seeded random wait to every step (the same seed on both sides, so the runs differ by
the planted change alone while each run's window-to-window spread is wide).

The waits are planted hours of the host clock (``HostHours``: an hour per millisecond
of the loop's planned wait), not sleeps or spins: the real work around them is a few
milliseconds a step, so what the gate sees is the plan alone, and a busy machine (whose
preemptions and slow wake-ups once moved the phases by more than the change under test)
cannot change a verdict.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.cli.compare_rows import MIN_BATCHES, Z, standard_error
from phase_timer.cli.compare_side import load_side
from phase_timer.cli import main
from phase_timer.outputs.run_summary import FILE_NAME
from phase_timer.timing.stats import WindowSeries
from tests.helpers import HostHours, hours, loader
from tests.cli.test_report import planted_memory, write_tensorboard_run

pytestmark = pytest.mark.timeout(300)

STEPS = 60
WINDOW = 6
# The planted waits, in hours of the host clock (HostHours).
FORWARD_H = 8.0
OPTIMIZER_H = 10.0
JITTER_H = 40.0  # noisy runs: up to this much more in forward, uniform, seeded


class WaitingSGD(torch.optim.SGD):
    def __init__(self, params, lr: float, clock: HostHours, wait_h: float) -> None:
        super().__init__(params, lr=lr)
        self.clock, self.wait_h = clock, wait_h

    def step(self, closure=None):  # type: ignore[override]
        self.clock.jump(self.wait_h)
        return super().step(closure)


class Waiting(nn.Module):
    def __init__(self, clock: HostHours, jitter_h: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.clock, self.jitter_h = clock, jitter_h
        self.rng = random.Random(1234)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.jump(FORWARD_H + self.rng.random() * self.jitter_h)
        return self.net(x)


def train(log_dir: Path, clock: HostHours, *, extra_optimizer_h: float = 0.0, jitter_h: float = 0.0,
          batch_size: int = 8) -> Path:
    """One real run of the plain door on ``clock``; returns its run directory (TensorBoard files, summary file)."""
    model = Waiting(clock, jitter_h)
    opt = WaitingSGD(model.parameters(), lr=0.01, clock=clock, wait_h=OPTIMIZER_H + extra_optimizer_h)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread, no waits on a pool thread another process preempted
    try:
        with phase_timer.attach(model, opt, loader(batch_size), log_dir=log_dir, window=WINDOW, warmup_steps=2,
                                summary=False) as timer:
            for i, (x, y) in enumerate(timer.loader):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if i == STEPS + 1:
                    break
    finally:
        torch.set_num_threads(threads)
    return Path(timer.log_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    plan = {
        "base": {},
        "same": {},
        "slow_optimizer": {"extra_optimizer_h": 10.0},
        "other_batch": {"batch_size": 16},
        "noisy": {"jitter_h": JITTER_H},
        "noisy_small": {"jitter_h": JITTER_H, "extra_optimizer_h": 3.0},
        "noisy_large": {"jitter_h": JITTER_H, "extra_optimizer_h": 15.0},
    }
    clock = HostHours()
    with pytest.MonkeyPatch.context() as m:  # the module's runs share one fixture: the clock is the module's too
        m.setattr(time, "perf_counter_ns", clock)
        return {name: train(root / name, clock, **kw) for name, kw in plan.items()}


def compare(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def compare_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, dict, str]:
    code, out, err = compare(capsys, "--json", *args)
    assert code in (0, 1), err
    return code, json.loads(out), err


# -- the gate ---------------------------------------------------------------------------
def test_two_runs_of_the_same_loop_pass_the_gate(runs, capsys):
    code, out, err = compare(capsys, runs["base"], runs["same"], "--fail-above", "5")
    assert code == 0, out + err
    assert "pass: no gated phase (step)" in out
    assert "warning" not in err  # same machine, same loop: nothing to warn about


def test_a_planted_sleep_in_optimizer_fails_the_gate_and_is_named(runs, capsys):
    code, out, err = compare(capsys, runs["base"], runs["slow_optimizer"], "--fail-above", "5")
    assert code == 1, out + err
    verdict = next(line for line in out.splitlines() if line.startswith("step +"))
    assert "slower (beyond noise" in verdict
    # The planted change is named first: the largest one (here the only one).
    assert verdict.split(": ", 1)[1].startswith("optimizer +"), verdict
    assert "FAIL: step slower by more than 5%" in out
    code, doc, _ = compare_json(capsys, runs["base"], runs["slow_optimizer"], "--fail-above", "5")
    opt = doc["phases"]["optimizer"]
    assert hours(opt["delta_ms"]) == 10, opt
    assert opt["beyond_noise"] is True
    assert doc["gate"]["failed"] == ["step"]
    # Gated on optimizer (10 -> 20: +100%) and step (18 -> 28: +56%) above 85%: optimizer alone fails.
    code, doc, _ = compare_json(capsys, runs["base"], runs["slow_optimizer"], "--fail-above", "85", "--phase",
                                "optimizer", "--phase", "step")
    assert code == 1 and doc["gate"]["failed"] == ["optimizer"], doc["phases"]


def test_without_a_threshold_the_gate_never_fails(runs, capsys):
    code, out, _ = compare(capsys, runs["base"], runs["slow_optimizer"])
    assert code == 0
    assert "FAIL" not in out and "step +" in out  # the verdict is still stated


def test_a_change_inside_the_noise_band_passes_and_a_larger_one_fails(runs, capsys):
    """The band comes from the runs: seeded jitter widens it; a change of 3 planted hours stays inside, 15 does not.

    ``--fail-above 0``: any slowdown beyond noise fails, so a pass is the band's doing.
    """
    code, doc, _ = compare_json(capsys, runs["noisy"], runs["noisy_small"], "--fail-above", "0")
    step = doc["phases"]["step"]
    assert step["delta_pct"] > 0, step  # slower, above the threshold...
    assert step["beyond_noise"] is False and step["noise_pct"] > step["delta_pct"], step  # ...but inside the band
    assert code == 0
    code, doc, _ = compare_json(capsys, runs["noisy"], runs["noisy_large"], "--fail-above", "0")
    assert code == 1 and doc["phases"]["step"]["beyond_noise"] is True
    # Two quiet runs have a narrower band: the band is the runs' own.
    _, quiet, _ = compare_json(capsys, runs["base"], runs["same"])
    assert quiet["phases"]["step"]["noise_pct"] < doc["phases"]["step"]["noise_pct"]


def test_the_band_is_the_batch_means_standard_error_of_each_run(runs):
    base, noisy = load_side(str(runs["base"])), load_side(str(runs["noisy"]))
    for side in (base, noisy):
        batches = side.batches["step"]["mean"]
        assert max(n for n, _ in batches) == WINDOW
        full = [v for n, v in batches if n >= WINDOW / 2]  # a window cut short by warmup or the end: left out
        assert len(full) >= MIN_BATCHES
        assert standard_error(batches) == pytest.approx(statistics.stdev(full) / len(full) ** 0.5)
    # Seeded jitter of up to 40 planted hours a step: the noisy run's windows spread more.
    assert standard_error(noisy.batches["step"]["mean"]) > standard_error(base.batches["step"]["mean"])


def test_the_verdict_reads_as_documented(runs, capsys):
    _, doc, _ = compare_json(capsys, runs["base"], runs["slow_optimizer"])
    step = doc["phases"]["step"]
    expected = f"step {step['delta_pct']:+.1f}% slower (beyond noise ±{step['noise_pct']:.1f}%): optimizer +"
    assert doc["verdicts"][0].startswith(expected), doc["verdicts"]
    assert step["noise_pct"] == pytest.approx(
        100 * Z * (standard_error(load_side(str(runs["base"])).batches["step"]["mean"]) ** 2
                   + standard_error(load_side(str(runs["slow_optimizer"])).batches["step"]["mean"]) ** 2) ** 0.5
        / step["baseline_ms"])


# -- sources ----------------------------------------------------------------------------
def test_a_summary_file_a_run_dir_and_the_dir_above_are_the_same_side(runs, capsys):
    a = compare_json(capsys, runs["base"] / FILE_NAME, runs["same"])[1]
    b = compare_json(capsys, runs["base"], runs["same"].parent)[1]
    assert a["phases"] == b["phases"]
    assert a["baseline"]["source"] == "summary"


def test_without_a_summary_file_the_tensorboard_windows_are_used_and_said(runs, capsys, tmp_path):
    old = tmp_path / "old_run"
    shutil.copytree(runs["base"], old)
    (old / FILE_NAME).unlink()
    code, doc, err = compare_json(capsys, runs["base"], old)
    assert code == 0
    assert doc["candidate"]["source"] == "windows"
    assert "no phase_timer_summary.json; its numbers come from the TensorBoard window summaries" in err
    # The step-weighted window means are the run's mean (TensorBoard keeps float32).
    for p, row in doc["phases"].items():
        assert row["candidate_ms"] == pytest.approx(row["baseline_ms"], rel=1e-5), p
        assert row["noise_pct"] is not None


def test_a_version_1_summary_file_takes_its_band_from_tensorboard_or_gates_on_the_threshold(runs, capsys, tmp_path):
    def to_v1(d):
        d["schema_version"] = 1
        del d["windows"]

    old = _edited_copy(runs["slow_optimizer"], tmp_path / "v1", to_v1)
    code, doc, err = compare_json(capsys, runs["base"], old, "--fail-above", "5")
    assert code == 1 and doc["phases"]["step"]["noise_pct"] is not None
    assert "noise band from TensorBoard windows beside the summary file" in err
    alone = tmp_path / "v1_alone"
    alone.mkdir()
    shutil.move(old / FILE_NAME, alone / FILE_NAME)  # no TensorBoard files beside it: no band
    code, out, err = compare(capsys, runs["base"], alone, "--fail-above", "5")
    assert code == 1 and "noise unknown" in out and "gated on the threshold alone" not in out  # it failed
    code, out, err = compare(capsys, runs["base"], alone, "--fail-above", "500")
    assert code == 0 and "step: noise unknown, gated on the threshold alone" in out


def test_warns_when_the_runs_are_not_comparable(runs, capsys):
    code, out, err = compare(capsys, runs["base"], runs["other_batch"])
    assert code == 0
    assert "warning: different batch size: baseline 8, candidate 16" in err


# -- bad input: exit 2, one line ---------------------------------------------------------
def _edited_copy(run: Path, dest: Path, edit) -> Path:
    shutil.copytree(run, dest)
    data = json.loads((dest / FILE_NAME).read_text())
    edit(data)
    (dest / FILE_NAME).write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such file or directory"),
        ("empty_dir", "no phase_timer_summary.json and"),
        ("corrupt_summary", "not JSON"),
        ("other_json", "not a phase-timer run summary"),
        ("future_version", "run summary version 99"),
        ("no_such_phase", "phase 'nope' is not in"),
        ("other_clock", "timed on the host clock and the candidate on the cuda clock"),
        ("negative_threshold", "--fail-above must be a percentage >= 0"),
        ("negative_memory_threshold", "--fail-above-memory must be a percentage >= 0"),
        ("two_runs_below", "run summaries ("),
    ],
)
def test_bad_input_exits_2_with_one_line(runs, capsys, tmp_path, case, message):
    base, cand, extra = runs["base"], runs["same"], []
    if case == "missing":
        cand = tmp_path / "nowhere"
    elif case == "empty_dir":
        cand = tmp_path / "empty"
        cand.mkdir()
    elif case == "corrupt_summary":
        cand = tmp_path / FILE_NAME
        cand.write_text('{"schema": "phase-timer/run-summary", "schema_ver')
    elif case == "other_json":
        cand = tmp_path / "x.json"
        cand.write_text('{"hello": 1}')
    elif case == "future_version":
        cand = _edited_copy(runs["same"], tmp_path / "v99", lambda d: d.update(schema_version=99))
    elif case == "no_such_phase":
        extra = ["--phase", "nope"]
    elif case == "other_clock":
        cand = _edited_copy(runs["same"], tmp_path / "gpu", lambda d: d["environment"].update(clock="cuda"))
    elif case == "negative_threshold":
        extra = ["--fail-above", "-1"]
    elif case == "negative_memory_threshold":
        extra = ["--fail-above-memory", "-1"]
    elif case == "two_runs_below":
        cand = runs["same"].parents[1]  # the root above every run
    code, out, err = compare(capsys, base, cand, *extra)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phase-timer compare: error: ") and message in lines[0], err


# -- memory (CUDA runs; planted in real files) --------------------------------------------
NO_BAND = "no noise band: the allocator's counters are deterministic in a steady loop"


def _with_memory(run: Path, dest: Path, peak_mb: float | None) -> Path:
    """A copy of a real run whose summary file has a planted ``memory`` (``peak_mb`` None: absent, as on a CPU)."""
    return _edited_copy(run, dest, lambda d: d.update(memory=None if peak_mb is None else planted_memory(peak_mb)))


def test_the_memory_gate_fails_above_its_threshold_and_passes_below(runs, capsys, tmp_path):
    base = _with_memory(runs["base"], tmp_path / "base", 1000.0)
    cand = _with_memory(runs["same"], tmp_path / "cand", 1100.0)
    code, out, err = compare(capsys, base, cand, "--fail-above-memory", "5")
    assert code == 1, out + err
    assert f"FAIL: peak allocated +10.0% (1000.0 -> 1100.0 MiB), more than 5% ({NO_BAND})" in out
    row = next(line for line in out.splitlines() if line.startswith("peak allocated "))
    assert row.split()[2:] == ["1000.0", "1100.0", "+100.0", "+10.0"]
    code, out, _ = compare(capsys, base, cand, "--fail-above-memory", "15")
    assert code == 0 and "pass: peak allocated +10.0% (1000.0 -> 1100.0 MiB), not more than 15%" in out
    code, out, _ = compare(capsys, cand, base, "--fail-above-memory", "0")  # less memory: never a failure
    assert code == 0 and "pass: peak allocated -9.1%" in out
    code, doc, _ = compare_json(capsys, base, cand, "--fail-above-memory", "5")
    assert code == 1 and doc["gate"]["memory_failed"] is True and doc["gate"]["fail_above_memory_pct"] == 5
    assert doc["gate"]["failed"] == []  # the time gate was not asked
    assert doc["memory"]["peak_allocated"] == {"baseline_mb": 1000.0, "candidate_mb": 1100.0, "delta_mb": 100.0,
                                               "delta_pct": pytest.approx(10.0)}
    assert doc["memory"]["activations"]["delta_pct"] == 0.0 and set(doc["memory"]) == {
        "peak_allocated", "peak_reserved", "activations"}


@pytest.mark.parametrize("lacking", ["baseline", "candidate"])
def test_the_memory_gate_without_memory_on_a_side_exits_2_naming_it(runs, capsys, tmp_path, lacking):
    with_mem = _with_memory(runs["base"], tmp_path / "with", 1000.0)
    without = _with_memory(runs["same"], tmp_path / "without", None)
    base, cand = (without, with_mem) if lacking == "baseline" else (with_mem, without)
    code, out, err = compare(capsys, base, cand, "--fail-above-memory", "5")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert str(without / FILE_NAME) in lines[0] and "no memory data for --fail-above-memory" in lines[0]
    # Not gated: compared on time alone, and the missing memory is said.
    code, doc, err = compare_json(capsys, base, cand)
    assert code == 0 and doc["memory"] is None
    assert f"{without / FILE_NAME}: no memory data; memory is compared only when both sides have it" in err


def test_the_memory_gate_on_tensorboard_runs_reads_the_last_peak(runs, capsys, tmp_path):
    base = write_tensorboard_run(tmp_path / "base", peak_mb=1410.0)  # peak points rising to 1410
    cand = write_tensorboard_run(tmp_path / "cand", peak_mb=1600.0)
    code, doc, _ = compare_json(capsys, base, cand, "--fail-above-memory", "10")
    assert code == 1 and doc["candidate"]["source"] == "windows"
    assert doc["memory"]["peak_allocated"]["baseline_mb"] == 1410.0
    assert doc["memory"]["peak_allocated"]["candidate_mb"] == 1600.0
    assert compare(capsys, base, cand, "--fail-above-memory", "20")[0] == 0
    # A summary file's memory and TensorBoard's compare with each other.
    summary = _with_memory(runs["base"], tmp_path / "summary", 1410.0)
    assert compare(capsys, summary, base, "--fail-above-memory", "0")[0] == 0
    bare = write_tensorboard_run(tmp_path / "bare", peak_mb=None)  # no phase_memory/* points
    code, _, err = compare(capsys, base, bare, "--fail-above-memory", "10")
    assert code == 2 and str(bare) in err and len(err.strip().splitlines()) == 1


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["compare", "only-one"])
    assert exc.value.code == 2


# -- the window series behind the band ----------------------------------------------------
def test_window_series_keeps_at_most_its_batches_and_merges_exactly():
    rng = random.Random(7)
    series = WindowSeries(max_batches=8)
    windows = []
    for k in range(37):
        values = sorted(rng.uniform(1, 3) for _ in range(5))
        summary = {"step": {"mean": statistics.fmean(values), "p50": values[2], "p90": values[4]}}
        series.add(5 * (k + 1), 5, summary, {"step": values})
        windows.append(values)
    assert 4 <= len(series.batches) <= 8 and series.windows_per_batch == 8
    # Complete batches only: 37 windows -> 4 batches of 8 (32 windows), 5 left filling.
    assert [s for s, _, _ in series.batches] == [40] * 4
    done = [v for w in windows[:32] for v in w]
    d = series.as_dict()
    merged = statistics.fmean(d["phases"]["step"]["mean_ms"])
    assert merged == pytest.approx(statistics.fmean(done))
    assert d["last_step"][-1] == 5 * 32
    assert d["windows_per_batch"] == 8 and d["steps"] == [40] * 4 and len(d["phases"]["step"]["p90_ms"]) == 4


def test_the_summary_file_carries_the_windows(runs):
    data = json.loads((runs["base"] / FILE_NAME).read_text())
    w = data["windows"]
    assert w["steps_per_window"] == WINDOW and w["windows_per_batch"] == 1
    assert sum(w["steps"]) == data["steps"]["timed"]
    means = w["phases"]["step"]["mean_ms"]
    weighted = sum(n * m for n, m in zip(w["steps"], means)) / sum(w["steps"])
    assert weighted == pytest.approx(data["phases"]["step"]["mean_ms"], rel=1e-6)
    # Lists of numbers are written one to a line: the file stays short.
    text = (runs["base"] / FILE_NAME).read_text()
    assert f'"steps": [{", ".join(map(str, w["steps"]))}]' in text
    assert os.path.getsize(runs["base"] / FILE_NAME) < 20_000
