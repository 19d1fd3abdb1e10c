"""The own-cost line (issue 39): an ordinary step's own host time, plus the sampled work amortized.

The verdict's sampled steps do work no ordinary step does (the Python path under a swapped class,
a probe of the device at each phase change), so their time is not what a step costs.  Here the
costs are planted on :class:`~tests.helpers.HostHours` -- each mark an hour, each probe an hour,
each window end five, each memory read one -- so that each figure of the line is known to the
hour whatever the machine's load; and a loop's own figure is set beside what
``benchmarks/host_cost.py`` measures of the same loop (the whole step's time through the boundaries).
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from benchmarks.host_cost import per_call_us
from phase_timer.measures import memory as memory_mod
from phase_timer.run import boundaries as boundaries_mod
from phase_timer.run.boundaries import Boundaries
from phase_timer.timing.clock import HostClock
from phase_timer.run.core import TimingCore
from phase_timer.outputs.table import format_own_cost
from tests.fakes import FakeAllocator
from tests.helpers import HOUR_MS, HostHours

HOUR_US = HOUR_MS * 1e3
PROBE_H, WINDOW_H, READ_H = 1, 5, 1  # planted hours: a probe (sampled steps only), a window's end, a memory read


class HourMarks(HostClock):
    """The host clock, each mark an hour of phase-timer's own time (a device's event record, planted)."""

    def __init__(self, hours: HostHours) -> None:
        self.hours, self.marks = hours, 0

    def mark(self) -> int:
        self.marks += 1
        self.hours.jump(1)
        return time.perf_counter_ns()


def step(bounds: Boundaries, i: int) -> None:
    """What the doors call at each step (host_cost.py's loop: in C where built)."""
    bounds.on_fetch()
    bounds.on_batch(i, 0.1)
    bounds.on_copied()
    bounds.on_backward_start()
    bounds.on_backward_end(False)
    bounds.on_optimizer_start()
    bounds.on_step_end()


@pytest.fixture
def planted(host_hours, monkeypatch) -> dict:
    """Probes, window ends and memory reads that cost planted hours, counted; memory read from a fake allocator."""
    counts = {"probes": 0, "windows": 0}
    probe, emit = TimingCore.probe_behind, TimingCore._emit

    def probe_behind(self: TimingCore) -> None:
        counts["probes"] += 1
        host_hours.jump(PROBE_H)
        probe(self)

    def _emit(self: TimingCore, *args) -> None:
        counts["windows"] += not self.closed  # the run's end is no step's
        host_hours.jump(WINDOW_H)
        emit(self, *args)

    monkeypatch.setattr(TimingCore, "probe_behind", probe_behind)
    monkeypatch.setattr(TimingCore, "_emit", _emit)
    alloc = FakeAllocator()
    read = alloc.read

    def slow_read():
        host_hours.jump(READ_H)
        return read()

    alloc.read = slow_read
    monkeypatch.setattr(memory_mod, "reader_for", lambda clock: (alloc.read, alloc.info))
    return {"counts": counts, "alloc": alloc, "hours": host_hours}


@pytest.mark.parametrize("steps", [60, 600])
def test_each_part_of_the_line_is_what_was_planted(planted, steps, monkeypatch):
    # The verdict's sampled steps come at random gaps: a fixed seed makes the schedule the same on every run.  (Where
    # the run's last step is a sampled one, its close at the run's end counts in the sampled steps' time, one mark
    # the line holds over the run that an ordinary last step's close does not: about 1 in 100 schedules of 600 steps.)
    monkeypatch.setattr(boundaries_mod, "random", SimpleNamespace(Random=lambda: random.Random(0)))
    clock = HourMarks(planted["hours"])
    core = TimingCore(clock, [], window=10, warmup_steps=5, max_pending=8, measures=memory_mod.Memory.listening(clock))
    bounds = Boundaries(core)
    marks_before = None
    for i in range(steps):
        if i == steps - 1:
            marks_before = clock.marks
        step(bounds, i)
    marks_per_step = clock.marks - marks_before  # the last step's, up to its end (its close is the finish's)
    bounds.finish()
    core.finish()
    counts, begun, samples = planted["counts"], core.steps_begun, len(core.signals.own_ns)
    # the line's figure: an ordinary step's marks, plus the probes, window ends and reads over the steps begun
    planted_total = marks_per_step + (PROBE_H * counts["probes"] + WINDOW_H * counts["windows"]
                                      + READ_H * planted["alloc"].reads) / begun
    assert core.own_us_per_step / HOUR_US == pytest.approx(planted_total, abs=1e-3)
    own = core.own_cost()
    assert own["ordinary_samples"] >= 5 and own["samples"] == samples >= 5
    # an ordinary step: its marks, and nothing else (no probe, no window end, no read)
    assert own["ordinary_us"] / HOUR_US == pytest.approx(marks_per_step, abs=1e-3)
    # a sampled step: the same marks and a probe at each phase change and its end
    probes = counts["probes"] / samples
    assert probes == 4 and own["sampled_us"] / HOUR_US == pytest.approx(marks_per_step + PROBE_H * probes, abs=1e-3)
    # amortized over the steps begun: the probes, every window end once (also those inside a sample), each read
    hour = HOUR_US / begun
    assert own["sampling_us_per_step"] == pytest.approx(PROBE_H * counts["probes"] * hour, rel=1e-4)
    assert counts["windows"] >= steps // 10 - 2
    assert own["windows_us_per_step"] == pytest.approx(WINDOW_H * counts["windows"] * hour, rel=1e-4)
    assert own["memory_us_per_step"] == pytest.approx(READ_H * planted["alloc"].reads * hour, rel=1e-4)
    assert own["us_per_step"] == pytest.approx(
        own["ordinary_us"] + own["windows_us_per_step"] + own["sampling_us_per_step"] + own["memory_us_per_step"])
    line = core.own_cost_line()
    assert f"ordinary steps {own['ordinary_us']:.1f} µs (median of {own['ordinary_samples']} timed apart); " \
           f"window ends {own['windows_us_per_step']:.1f}, the verdict's sampled steps " \
           f"{own['sampling_us_per_step']:.1f} and memory reads {own['memory_us_per_step']:.1f} µs/step amortized " \
           f"over {begun} steps" in line


def test_with_no_ordinary_step_timed_the_sampled_steps_stand_for_one_as_an_upper_bound():
    own = {"us_per_step": 40.0, "share_of_period": 0.01, "samples": 3, "ordinary_us": None, "ordinary_samples": 0,
           "sampled_us": 35.0, "windows_us_per_step": 1.0, "sampling_us_per_step": 0.0, "memory_us_per_step": 4.0,
           "long_run_us_per_step": 36.5, "steps": 30, "host_ahead": False}
    line = format_own_cost(own)
    assert line == ("phase-timer's own host time: ≈40.0 µs/step (1.00% of period): 35.0 µs on the verdict's 3 "
                    "sampled steps, which do extra work (an upper bound: no ordinary step was timed); window ends 1.0 "
                    "and memory reads 4.0 µs/step amortized over 30 steps")


def test_a_summary_file_from_before_says_what_it_held():
    own = {"us_per_step": 834.8, "share_of_period": 0.0073, "samples": 8, "memory_us_per_step": 230.0,
           "host_ahead": False}
    assert format_own_cost(own) == "phase-timer's own host time: 834.8 µs/step (0.73% of period), sampled on 8 steps"


def test_a_short_runs_dense_start_is_said_beside_a_long_runs_rate():
    own = {"us_per_step": 342.0, "share_of_period": 0.003, "samples": 8, "ordinary_us": 95.0, "ordinary_samples": 8,
           "sampled_us": 180.0, "windows_us_per_step": 5.0, "sampling_us_per_step": 12.0, "memory_us_per_step": 230.0,
           "long_run_us_per_step": 104.0, "steps": 76, "host_ahead": False}
    assert format_own_cost(own) == (
        "phase-timer's own host time: ≈342.0 µs/step (0.30% of period): ordinary steps 95.0 µs (median of 8 timed "
        "apart); window ends 5.0, the verdict's sampled steps 12.0 and memory reads 230.0 µs/step amortized over 76 "
        "steps (≈104.0 µs/step over a long run: the first steps are sampled densely)")


@pytest.mark.timeout(120)
def test_the_line_agrees_with_host_costs_figure_for_the_same_loop():
    """host_cost.py's figure for a step through the boundaries is the whole loop's time a step (the loop does
    nothing else); the line's estimate of the same run is phase-timer's own share of it: at most about all of it,
    and most of it (the rest is the loop's own calls).  The sampled steps alone read 3-5x the whole loop here."""
    core = TimingCore(HostClock(), [], window=50, warmup_steps=5, max_pending=64)
    bounds = Boundaries(core)
    state = {"i": 0}

    def one() -> None:
        state["i"] += 1
        step(bounds, state["i"])

    for _ in range(200):
        one()
    loop_us = per_call_us(one, 2000, repeats=3)  # host_cost.py's measure: the median of three runs' mean step
    own_us = core.own_us_per_step
    core.finish()
    assert loop_us / 4 <= own_us <= 1.5 * loop_us, (own_us, loop_us)
