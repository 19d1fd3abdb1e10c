"""RUN_CHANGED (issue 48): a phase whose level moved partway through the run, when, by how much, which rank."""

from __future__ import annotations

import json
import random

import pytest
import torch

from phase_timer.diagnosis.run_change import find_shift
from tests import helpers
from tests.helpers import HOUR_MS


def _points(values: list[float]) -> list[tuple[int, float]]:
    return [(10 * (i + 1) - 1, v) for i, v in enumerate(values)]  # windows of 10 steps: last steps 9, 19, ...


def test_a_level_that_moves_and_stays_is_found_where_it_moved() -> None:
    rng = random.Random(0)
    drop = [130 + rng.uniform(-3, 3) for _ in range(4)] + [3 + rng.uniform(-0.2, 0.2) for _ in range(6)]
    k, before, after, _ = find_shift(_points(drop), 0.1)
    assert k == 4 and before == pytest.approx(130, abs=3) and after == pytest.approx(3, abs=0.2)
    rise = [0.4] * 10 + [20.7] * 10
    k, before, after, _ = find_shift(_points(rise), 0.1)
    assert (k, before, after) == (10, 0.4, 20.7)


@pytest.mark.parametrize("values", [
    [10 + 0.5 * ((-1) ** i) for i in range(12)],  # noise about one level
    [10 + i for i in range(12)],  # a steady trend: no level that moved and stayed
    [10.0] * 6 + [60.0] + [10.0] * 5,  # one spike (UNSTABLE's, not a change)
    [10.0, 30.0] + [10.0] * 10,  # a slow start of one window: too short a side
    [10.0] * 6 + [10.5] * 6,  # 5%: below the share that counts
])
def test_noise_trends_spikes_and_small_steps_are_no_change(values: list[float]) -> None:
    assert find_shift(_points(values), 0.1) is None


class _Sleepy(torch.nn.Module):
    """A forward that waits: on the host-hours clock (``host_hours``), ``pause(s)`` is ``1000 s`` hours, exact
    whatever the machine's load; every forward waits at least ``BASE_S`` so that no real-time noise of the
    other phases can move a level."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.sleep_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        helpers.pause(BASE_S + self.sleep_s)
        return self.lin(x)


BASE_S = 0.001  # an hour a forward


def _run(tmp_path, sleep_s: float, from_step: int, until_step: int, steps: int = 100):  # noqa: ANN001, ANN202
    import phase_timer

    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    data = [torch.randn(4, 8) for _ in range(steps)]
    with phase_timer.attach(model, opt, data, log_dir=tmp_path, warmup_steps=2, window=10) as timer:
        for i, x in enumerate(timer.loader):
            model.sleep_s = sleep_s if from_step <= i < until_step else 0.0
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return timer


def _changed(timer) -> dict:  # noqa: ANN001
    d = timer.diagnosis
    found = [f for f in (d, *d.secondary) if f.kind == "RUN_CHANGED"]
    assert len(found) == 1, [f.kind for f in (d, *d.secondary)]
    return found[0]


def test_a_forward_that_turns_slow_at_step_50_is_named_with_its_step_in_every_output(tmp_path, host_hours) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    timer = _run(tmp_path, 0.02, 50, 10**9)
    f = _changed(timer)
    ev = f.evidence
    assert ev["phase"] == "forward" and ev["rank"] is None
    assert 45 <= ev["at_step"] <= 55, ev
    assert round(ev["before_ms"] / HOUR_MS) == 1 and round(ev["after_ms"] / HOUR_MS) == 21
    assert f.severity == "medium"  # most of the step
    assert "forward went from" in f.why and f"step ~{ev['at_step']}" in f.why
    assert "RUN_CHANGED" in timer.last_summary  # the table's findings
    with open(timer.summary_path) as fh:
        doc = json.load(fh)
    kinds = [doc["diagnosis"]["kind"], *(s["kind"] for s in doc["diagnosis"]["secondary"])]
    assert "RUN_CHANGED" in kinds  # the summary file
    acc = EventAccumulator(timer.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("phase_timer/diagnosis/text_summary")
    assert "RUN_CHANGED" in event.tensor_proto.string_val[0].decode()  # TensorBoard's text


def test_a_step_that_drops_from_slow_to_fast_is_a_change_too(tmp_path, host_hours) -> None:
    timer = _run(tmp_path, 0.03, 0, 40)  # 31 hours a forward for 4 windows, then 1
    ev = _changed(timer).evidence
    assert ev["phase"] == "forward" and ev["after_ms"] < 0.1 * ev["before_ms"]
    assert 35 <= ev["at_step"] <= 45


def test_a_steady_run_has_no_change(tmp_path, host_hours) -> None:
    timer = _run(tmp_path, 0.0, 0, 0)
    d = timer.diagnosis
    assert "RUN_CHANGED" not in [f.kind for f in (d, *d.secondary)]


def test_compare_says_which_side_changed_partway(tmp_path, capsys, host_hours) -> None:
    from phase_timer.cli import main

    steady = _run(tmp_path / "a", 0.0, 0, 0)
    changed = _run(tmp_path / "b", 0.02, 50, 10**9)
    code = main(["compare", steady.log_dir, changed.log_dir])
    out = capsys.readouterr().out
    assert code == 0
    assert "the candidate changed partway through its run: forward went from" in out
    assert "the baseline changed" not in out


def test_a_rank_that_turns_slow_midway_is_named() -> None:
    """Two real processes (gloo): rank 1's forward sleeps 30 ms from its 30th step on, and its host clock moves
    30 hours there (``--planted-hours``): the others' wait for it (30 ms in their backward) never reads as the
    change."""
    import os
    import sys
    import tempfile

    from tests.distributed.test_distributed import ROOT, SCRIPTS, _run as run_dist

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(SCRIPTS, "plain_ddp.py"), "--log-dir", tempfile.mkdtemp(dir=ROOT + "/.."),
           "--steps", "62", "--window", "6", "--slow-forward", "0.03", "--slow-from", "30", "--planted-hours"]
    _, result = run_dist(cmd)
    d = result["diagnosis"]
    found = [f for f in (d, *d["secondary"]) if f["kind"] == "RUN_CHANGED"]
    assert found, [f["kind"] for f in (d, *d["secondary"])]
    ev = found[0]["evidence"]
    assert ev["phase"] == "forward" and ev["rank"] == 1, ev
    assert 24 <= ev["at_step"] <= 36, ev
    assert "rank 1's forward went from" in found[0]["why"]
