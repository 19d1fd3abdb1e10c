"""Boundaries, driven directly on the host clock: the corner cases the doors reach rarely.

The host clock here is virtual: ``time.perf_counter_ns`` is replaced for the test by a
counter that only :func:`nap` moves, so every figure is exact and a loaded CI machine
(where a 2 ms sleep can take 8) cannot move it. The core, the boundaries and the engine
(C or Python) all read that one function, so they see the same virtual time.
"""

from __future__ import annotations

import time

import pytest

from phase_timer.boundaries import Boundaries
from phase_timer.clock import HostClock
from phase_timer.core import TimingCore

_now = [0]


def nap(ms: float) -> None:
    _now[0] += round(ms * 1e6)


@pytest.fixture(autouse=True)
def virtual_time(monkeypatch):
    _now[0] = 1_000_000_000
    monkeypatch.setattr(time, "perf_counter_ns", lambda: _now[0])


def run(drive) -> dict[str, list[float]]:
    """Each phase's per-step values, from a real core on the (virtual) host clock."""
    got: dict[str, list[float]] = {}

    class Collect:
        def write(self, step, scalars):
            for tag, v in scalars.items():
                if tag.startswith("phase_time_step/"):
                    got.setdefault(tag.split("/")[1].removesuffix("_ms"), []).append(v)

        def flush(self):
            pass

        def close(self):
            pass

    core = TimingCore(HostClock(), [Collect()], window=100, warmup_steps=0, max_pending=8, per_step=True)
    bounds = Boundaries(core)
    drive(bounds)
    bounds.finish()
    core.finish()
    return got


def micro_batch(b: Boundaries, *, fetch_twice: bool = False, broadcast_ms: float = 0.0) -> None:
    b.fetch()
    if fetch_twice:  # Lightning under DDP: its broadcast, then its fetch, report the same fetch
        nap(broadcast_ms)
        b.fetch()
    b.batch(sync_wait_ms=broadcast_ms)
    b.copied()
    nap(2)
    b.backward_start()
    nap(2)
    b.backward_end()


def test_a_second_fetch_report_before_the_batch_changes_nothing():
    def drive(b: Boundaries) -> None:
        for _ in range(3):
            micro_batch(b, fetch_twice=True, broadcast_ms=5)
            micro_batch(b, fetch_twice=True, broadcast_ms=5)  # accumulation: two micro-batches
            b.optimizer_start()
            b.step_end()

    got = run(drive)
    assert len(got["step"]) == 3
    assert got["sync_wait"] == pytest.approx([10.0] * 3)  # one broadcast per micro-batch, counted once
    assert got["idle"] == pytest.approx([0.0] * 3)  # the broadcast is not the device's idle time
    assert got["step"] == pytest.approx([8.0] * 3)  # two micro-batches of 2 + 2
    assert got["period"] == pytest.approx([18.0] * 2)  # the broadcasts are in the period, not the step


def test_period_after_a_dropped_batch_does_not_carry_it():
    def drive(b: Boundaries) -> None:
        for i in range(4):
            micro_batch(b)
            if i == 2:  # its backward raised; the loop skips the batch
                b.in_backward = True
                b.backward_end(failed=True)
                nap(30)
                continue
            b.optimizer_start()
            b.step_end()

    got = run(drive)
    assert len(got["step"]) == 3  # the failed batch is dropped
    assert got["period"] == pytest.approx([4.0, 4.0]), got["period"]  # and no period holds its 30 ms


def test_a_user_phase_open_across_the_end_runs_on_under_its_name_outside_the_step():
    def drive(b: Boundaries) -> None:
        for _ in range(3):
            micro_batch(b)
            b.enter("stepping")
            nap(3)
            b.optimizer_start()
            b.step_end()
            b.step_end()  # a GradScaler's update right after
            nap(5)
            b.exit()
            nap(1)

    got = run(drive)
    assert "between_steps" in got
    for i in range(3):
        assert got["stepping"][i] == pytest.approx(8.0)  # 3 inside the step, 5 after its end
        assert got["step"][i] == pytest.approx(4 + 3)  # the 5 ms after the end are not the step's
        assert got["between_steps"][i] == pytest.approx(1.0)
    assert got["period"] == pytest.approx([13.0, 13.0])
