"""The verdict: every rule from crafted totals (abstaining on missing signals), then real runs.

Real runs: a loader with a planted sleep is INPUT_BOUND and names ``num_workers=0`` (both
doors); a short run is TOO_FEW_STEPS; the summary file validates against its schema and is
written after an exception too; the verdict reaches TensorBoard as text.  The 2-rank
straggler is in ``test_distributed.py``; the GPU verdicts in ``test_gpu.py``.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import jsonschema
import pytest
import torch
from torch import nn

import phase_timer
from phase_timer import PhaseTimer
from phase_timer.run.core import TimingCore
from phase_timer.diagnosis import MIN_STEPS, Diagnosis, Signals, diagnose, format_verdict
from phase_timer.timing.resolver import Resolver
from phase_timer.outputs.run_summary import FILE_NAME, schema
from phase_timer.timing.stats import RunTotals
from phase_timer.phases import EXPOSED_WAIT
from tests.fakes import FakeClock
from tests.helpers import loader, module_class, trainer


def totals(steps: int = 100, **means: float) -> RunTotals:
    """Run totals of ``steps`` steps with these mean ms per phase (``step`` and ``period`` derived if absent)."""
    device = sum(v for p, v in means.items() if p in ("h2d", "forward", "backward", "optimizer"))
    means.setdefault("step", device)
    means.setdefault("period", means["step"] + means.get("data_wait", 0.0) + means.get("sync_wait", 0.0)
                     + means.get("between_steps", 0.0))
    t = RunTotals()
    t.add_window(steps, {p: [v] * steps for p, v in means.items()})
    return t


GPU_STEP = {"h2d": 0.5, "forward": 10.0, "backward": 20.0, "optimizer": 2.0}


def signals(flight: dict[int, int] | None = None, host_step_ms: float | None = None, n: int = 10) -> Signals:
    s = Signals()
    if flight:
        s.flight.update(flight)
    if host_step_ms is not None:
        s.host_step_ms = [host_step_ms] * n
    return s


# -- each rule --------------------------------------------------------------------------
def test_too_few_steps_says_how_many_are_needed():
    d = diagnose(totals(MIN_STEPS - 1, data_wait=50.0, **GPU_STEP), Signals(), clock="cuda", warmup_steps=5)
    assert d.kind == "TOO_FEW_STEPS"
    assert f"{MIN_STEPS}" in d.next[0] and f"{MIN_STEPS + 5}" in d.next[0]
    assert d.secondary == ()  # no other rule speaks on so few steps


def test_input_bound_names_the_loaders_settings():
    loader_info = {"type": "DataLoader", "num_workers": 0, "pin_memory": False, "persistent_workers": False,
                   "prefetch_factor": None, "batch_size": 32}
    d = diagnose(totals(data_wait=10.0, **GPU_STEP), Signals(), clock="cuda",
                 context={"loader": loader_info, "cpu_count": 16, "device_type": "cuda"})
    assert d.kind == "INPUT_BOUND" and d.severity == "medium"
    # no CPU readings here: it says what it could not tell (tests/diagnosis/test_input_advice.py has the measured cases)
    assert "num_workers=0" in d.next[0] and "could not read the CPU time" in d.next[0]
    assert any("pin_memory=False" in tip for tip in d.next)
    assert d.evidence["share_of_period"] == pytest.approx(10 / 42.5)


def test_input_bound_with_workers_and_a_steady_wait_never_says_prefetch_factor_2():
    """prefetch_factor=2 is the default, and a deeper prefetch evens out bursts, not a steady wait (issue 36)."""
    info = {"type": "DataLoader", "num_workers": 2, "pin_memory": True, "persistent_workers": False,
            "prefetch_factor": 2, "batch_size": 32}
    d = diagnose(totals(data_wait=40.0, **GPU_STEP), Signals(), clock="cuda", context={"loader": info, "cpu_count": 32})
    text = " ".join(d.next)
    assert d.severity == "high"
    assert "the 2 workers do not keep up" in text and "could not read the CPU time" in text
    assert "prefetch" not in text and "persistent_workers" not in text


def test_without_a_data_wait_the_input_rule_abstains():
    d = diagnose(totals(**GPU_STEP), signals({3: 10}), clock="cuda")
    assert d.kind == "GPU_BOUND"
    assert all(f.kind != "INPUT_BOUND" for f in (d, *d.secondary))


#: Rank 1 of the 4 x H200 run (a ~1B GPT under DDP, its loader sleeping 20 ms a batch): a device queue more than
#: 20 ms deep runs through the sleep; period - step - between_steps is 0.008 ms.
HIDDEN = {"data_wait": 20.127, "h2d": 0.012, "forward": 45.456, "backward": 104.212, "optimizer": 12.757,
          "between_steps": 0.003, "period": 162.448}


def test_on_a_device_clock_a_wait_the_device_s_queue_hides_is_said_as_info_not_input_bound():
    d = diagnose(totals(**HIDDEN), signals({2: 10}), clock="cuda")
    assert d.kind == "GPU_BOUND"  # what holds the run back; the wait comes after it
    f = _only(d, "INPUT_BOUND")
    assert f.severity == "info" and f.evidence["hidden"] is True
    assert f.evidence["data_wait_exposed_ms"] == pytest.approx(0.008, abs=1e-6)
    assert f.evidence["data_wait_share_of_period"] == pytest.approx(20.127 / 162.448)
    assert "20.13 ms a step" in f.why and "hidden behind the device's queue" in f.why and "0.01 ms" in f.why
    assert "nothing to gain now" in f.why and f.next[0].startswith("nothing to change now")
    assert format_verdict(d).startswith("verdict: GPU_BOUND")
    # with nothing else to say, the note is the verdict, never medium
    alone = diagnose(totals(**HIDDEN), Signals(), clock="cuda")
    assert (alone.kind, alone.severity) == ("INPUT_BOUND", "info")


def test_on_a_device_clock_input_bound_weighs_the_wait_by_its_part_that_reached_the_device():
    """The 2-GPU case: the device idles 7.5 ms of the 20 ms wait (period 58.0, step 50.5)."""
    d = diagnose(totals(data_wait=20.0, h2d=0.5, forward=15.0, backward=30.0, optimizer=5.0, period=58.0),
                 signals({0: 10}), clock="cuda")
    f = _only(d, "INPUT_BOUND")
    assert d.kind == "INPUT_BOUND" and f.severity == "medium"
    assert f.evidence["share_of_period"] == pytest.approx(7.5 / 58.0) and f.evidence["hidden"] is False
    assert "20.00 ms a step for its next batch and 7.50 ms a step of it reaches the device" in f.why
    # high from the exposed part's share, not the wait's: 20 of 40 ms idle is 50%
    d = diagnose(totals(data_wait=20.0, forward=20.0, period=40.0), Signals(), clock="cuda")
    assert d.severity == "high" and d.evidence["share_of_period"] == pytest.approx(0.5)
    d = diagnose(totals(data_wait=40.0, forward=50.0, period=60.0), Signals(), clock="cuda")
    assert d.severity == "medium" and d.evidence["data_wait_exposed_ms"] == pytest.approx(10.0)


def test_the_exposed_wait_is_each_window_s_not_the_run_s_means():
    """One window's idle cannot hide another window's wait: per window min(data_wait, period - step - between)."""
    t = RunTotals()
    s = Signals()
    idle = {"data_wait": [0.0] * 50, "forward": [30.0] * 50, "step": [30.0] * 50, "period": [45.0] * 50}
    busy = {"data_wait": [15.0] * 50, "forward": [30.0] * 50, "step": [30.0] * 50, "period": [30.0] * 50}
    for cols in (idle, busy):
        s.add_wait(50, t.add_window(50, cols) or _summary(cols), {p: len(v) for p, v in cols.items()})
    assert s.wait_exposed_ms == 0.0 and s.wait_steps == 100
    f = _only(diagnose(t, s, clock="cuda"), "INPUT_BOUND")
    assert f.severity == "info"
    # the run's totals alone (no window seen) would read 7.5 ms a step exposed
    assert _only(diagnose(t, Signals(), clock="cuda"), "INPUT_BOUND").severity == "medium"
    # a phase missing from some steps counts 0 there: 10 waits of 15 ms in 50 steps (3 ms a step), 6 ms a step idle
    s2 = Signals()
    cols = {"data_wait": [15.0] * 10, "step": [30.0] * 50, "period": [36.0] * 50}
    assert s2.add_wait(50, _summary(cols), {p: len(v) for p, v in cols.items()}) == pytest.approx(150.0)
    # ... and period over the steps that have one (a run's first step has none)
    cols = {"data_wait": [15.0] * 50, "step": [30.0] * 50, "period": [36.0] * 49}
    assert s2.add_wait(50, _summary(cols), {p: len(v) for p, v in cols.items()}) == pytest.approx(300.0)


def _summary(cols):
    from phase_timer.timing.stats import summarize_columns

    return summarize_columns({p: sorted(v) for p, v in cols.items()})


def test_on_the_host_clock_the_whole_wait_is_input_bound_as_before():
    d = diagnose(totals(**HIDDEN), signals({2: 10}), clock="host")
    assert (d.kind, d.severity) == ("INPUT_BOUND", "medium")
    assert d.why == ("the loop waits 20.13 ms a step for its next batch: 12% of the time per step "
                     "(data_wait of period)")
    assert d.evidence["share_of_period"] == pytest.approx(20.127 / 162.448) and "hidden" not in d.evidence


def test_h2d_bound_on_its_share_of_step():
    d = diagnose(totals(h2d=8.0, forward=10.0, backward=20.0, optimizer=2.0), signals({2: 10}), clock="cuda",
                 context={"loader": {"type": "DataLoader", "pin_memory": False, "num_workers": 4}})
    assert d.kind == "H2D_BOUND"
    assert "pin_memory=False" in d.next[0] and "non_blocking=True" in d.next[0]
    assert d.evidence["share_of_step"] == pytest.approx(0.2)


def test_h2d_bound_on_the_host_clock_names_the_loops_work_not_a_copy():
    """On a CPU run there is no device copy: pinned memory and non_blocking would be wrong advice."""
    d = diagnose(totals(h2d=8.0, forward=10.0, backward=20.0, optimizer=2.0), Signals(), clock="host",
                 context={"loader": {"type": "DataLoader", "pin_memory": False, "num_workers": 4}})
    assert d.kind == "H2D_BOUND" and "host clock" in d.why and "not a device copy" in d.why
    assert not any("pin" in tip or "non_blocking" in tip for tip in d.next), d.next
    assert d.evidence["share_of_step"] == pytest.approx(0.2)


def test_sync_wait_is_lightnings_broadcast():
    d = diagnose(totals(sync_wait=10.0, **GPU_STEP), Signals(), clock="cuda")
    assert d.kind == "SYNC_WAIT" and "broadcast" in d.why


def test_host_bound_needs_both_the_idle_device_and_the_paced_step():
    t = totals(**GPU_STEP)  # device step 32.5 ms
    d = diagnose(t, signals({0: 9, 1: 1}, host_step_ms=31.0), clock="cuda")
    assert d.kind == "HOST_BOUND"
    assert "set_sync_debug_mode" in " ".join(d.next) and "CUDA graphs" in " ".join(d.next)
    assert d.evidence["share_at_zero_in_flight"] == pytest.approx(0.9)
    # The device idle at each step's end, but its step far longer than the host's: a per-step
    # sync on a busy GPU (loss.item()), not a host-bound run.
    d = diagnose(t, signals({0: 10}, host_step_ms=10.0), clock="cuda")
    assert d.kind == "GPU_BOUND" and "waits for the GPU inside each step" in d.why


def test_a_device_still_running_only_the_steps_tail_is_host_bound():
    """Nothing earlier in flight, the host's step about as long as the device's, the device still running
    the step's last span (a heavy optimizer) at every close, but never more than a span behind inside the
    step: the device waits for the host (an eager GPT-2 in Lightning on an H100: busy 0.5 on the profiler's
    timeline).  The tail alone is no sign of a busy GPU; the device behind inside the step is."""
    s = signals({0: 10}, host_step_ms=30.0)
    s.tail_checked, s.tail_busy = 10, 10
    s.behind_checked, s.behind = 120, 30  # the step's end and a few more: a quarter of the boundaries
    d = diagnose(totals(**GPU_STEP), s, clock="cuda")
    assert d.kind == "HOST_BOUND" and d.evidence["tail_busy"] == 10
    s.behind = 36  # 30%: the most a host-held run has read (the plain GPT-2 at busy 0.51, 29 of 96)
    assert diagnose(totals(**GPU_STEP), s, clock="cuda").kind == "HOST_BOUND"
    s.behind = 60  # behind at half the boundaries (a sync mid-step on a busy GPU): GPU_BOUND
    d = diagnose(totals(**GPU_STEP), s, clock="cuda")
    assert d.kind == "GPU_BOUND" and "more than a phase behind" in d.why


def test_a_device_more_than_a_phase_behind_inside_the_step_is_not_host_bound():
    """The host issues a step no faster than the device runs it and nothing is in flight at the closes
    (the loop reads the loss after each step), but inside the step the device had not begun the span
    the host had just issued: the host was held to the device's pace (a full launch queue), GPU_BOUND."""
    s = signals({0: 10}, host_step_ms=32.0)
    s.tail_checked, s.tail_busy = 10, 0
    s.behind_checked, s.behind = 40, 34
    d = diagnose(totals(**GPU_STEP), s, clock="cuda")
    assert d.kind == "GPU_BOUND" and "more than a phase behind" in d.why and "85%" in d.why
    assert "never got a step ahead" in d.why and d.evidence["behind"] == 34
    s.behind = 3  # the device had begun nearly every span by the time the host issued the next: host-bound
    d = diagnose(totals(**GPU_STEP), s, clock="cuda")
    assert d.kind == "HOST_BOUND" and d.evidence["behind_checked"] == 40
    s.behind_checked, s.behind = 3, 3  # too few boundaries checked to say: the other signals decide
    assert diagnose(totals(**GPU_STEP), s, clock="cuda").kind == "HOST_BOUND"


@pytest.mark.parametrize("lag", [0, 3])
def test_the_python_engine_says_whether_the_device_is_a_phase_behind(lag):
    from phase_timer.timing.clock import HostClock
    from phase_timer.timing.engine import PyEngine

    engine = PyEngine(FakeClock(lag=lag), window=10, max_pending=8)
    assert engine.behind() is None  # no record
    engine.open(0, "forward")
    assert engine.behind() is None  # one mark: nothing issued before it
    engine.switch("backward")
    assert engine.behind() is (lag > 0)  # forward's start mark: done at once, or after `lag` queries
    host = PyEngine(HostClock(), window=10, max_pending=8)
    host.open(0, "forward")
    host.switch("backward")
    assert host.behind() is None  # the host clock: no device to be behind


def test_device_rules_abstain_without_their_signals():
    t = totals(**GPU_STEP)
    # the host clock: nothing is in flight there
    assert diagnose(t, signals({0: 10}, host_step_ms=32.0), clock="host").kind == "NO_FINDING"
    # too few sampled steps
    assert diagnose(t, signals({0: 3}, host_step_ms=32.0, n=3), clock="cuda").kind == "NO_FINDING"
    # samples of steps in flight but no host step times: HOST_BOUND cannot say the device is paced
    d = diagnose(t, signals({0: 10}), clock="cuda")
    assert d.kind == "NO_FINDING" and "HOST_BOUND" not in [f.kind for f in d.secondary]


def test_gpu_bound_names_the_largest_phase_and_what_to_try():
    t = totals(h2d=0.1, forward=5.0, backward=4.0, optimizer=4.0)
    d = diagnose(t, signals({4: 8, 5: 2}), clock="cuda", context={"precision": "32-true"})
    assert d.kind == "GPU_BOUND" and d.severity == "info"
    assert d.evidence["largest_phase"] == "forward" and d.evidence["median_in_flight"] == 4
    text = " ".join(d.next)
    assert "fused=True" in text  # optimizer 31% of step
    assert "bf16" in text  # fp32
    d = diagnose(t, signals({4: 10}), clock="cuda", context={"precision": "bf16-mixed"})
    assert "bf16" not in " ".join(d.next)


def test_unstable_windows():
    s = Signals()
    spiky = {"step": {"p50": 10.0, "p90": 18.0, "max": 30.0}, "period": {"p50": 11.0, "p90": 12.0, "max": 13.0}}
    calm = {"step": {"p50": 10.0, "p90": 11.0, "max": 12.0}, "period": {"p50": 11.0, "p90": 12.0, "max": 13.0}}
    for summary in (spiky, spiky, calm):
        s.add_window(50, summary)
    s.add_window(5, spiky)  # too short a window to judge
    assert (s.windows, s.spiky_windows) == (3, 2)
    d = diagnose(totals(**GPU_STEP), s, clock="host")
    assert d.kind == "UNSTABLE" and "gc.freeze()" in d.next[0]
    s2 = Signals()
    for summary in (spiky, spiky):  # two windows are too few
        s2.add_window(50, summary)
    assert diagnose(totals(**GPU_STEP), s2, clock="host").kind == "NO_FINDING"


def spreads(means: dict) -> dict:
    """A window across ranks as the exchange hands it over: each phase's spread of per-rank means."""
    from phase_timer.distributed.ranks import RankWindow

    return RankWindow.from_means(0, 0, means).phases


def test_rank_straggler_from_windows_not_from_the_ranks_that_wait():
    s = Signals()
    for _ in range(5):
        # rank 2 is slow in forward; ranks 0 and 1 wait for it in backward (never the straggler's phase)
        s.add_rank_window(spreads({"forward": {0: 10.0, 1: 10.2, 2: 16.0}, "backward": {0: 26.0, 1: 25.8, 2: 20.0},
                                   "period": {0: 40.0, 1: 40.0, 2: 40.1}}))
    s.add_rank_window(spreads({"forward": {0: 10.0, 1: 10.1, 2: 10.0}, "period": {0: 30.0, 1: 30.0, 2: 30.0}}))

    class Rt:  # the per-rank run totals the exchange keeps
        sums = {0: {}, 1: {}, 2: {}}

        def mean(self, rank, phase):
            return {0: 26.0, 1: 25.8, 2: 20.0}[rank] if phase == "backward" else None

    d = diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=Rt())
    assert d.kind == "RANK_STRAGGLER"
    assert (d.evidence["rank"], d.evidence["phase"], d.evidence["windows"], d.evidence["of_windows"]) == (2, "forward", 5, 6)
    assert d.evidence["margin_ms"] == pytest.approx(5.9)  # over the other ranks' median (10.1), not all three's
    assert d.evidence["others_backward_wait_ms"] == pytest.approx(5.9)
    assert "rank 2" in d.why and "all-reduce" in " ".join(d.next)
    # a margin below 5% of period is no straggler
    s3 = Signals()
    for _ in range(5):
        s3.add_rank_window(spreads({"forward": {0: 10.0, 1: 10.5}, "period": {0: 40.0, 1: 40.0}}))
    assert diagnose(totals(**GPU_STEP), s3, clock="host").kind == "NO_FINDING"


class RankSums:
    """Per-rank run totals as the exchange keeps them: ``{rank: {phase: mean ms}}`` over ``steps`` steps."""

    def __init__(self, means: dict, steps: int = 100) -> None:
        self.sums = {r: {p: [m * steps, steps] for p, m in by.items()} for r, by in means.items()}

    def mean(self, rank, phase):
        acc = self.sums.get(rank, {}).get(phase)
        return acc[0] / acc[1] if acc else None


def test_two_ranks_the_slow_one_is_measured_against_the_other_not_the_mean_of_both():
    """Issue 47: rank 1 is 10.5 ms slower in forward; with two ranks the median of both is half-way to it."""
    s = Signals()
    for _ in range(4):
        s.add_rank_window(spreads({"forward": {0: 0.86, 1: 11.36}, "period": {0: 14.0, 1: 14.0}}))
    d = diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=RankSums({0: {"forward": 0.86}, 1: {"forward": 11.36}}))
    assert d.kind == "RANK_STRAGGLER" and d.evidence["rank"] == 1
    assert d.evidence["margin_ms"] == pytest.approx(10.5)
    assert "10.50 ms a step above the other ranks' median" in d.why


def test_the_straggler_the_all_reduce_hides_is_named_from_the_waits():
    """Issue 47: rank 1 loses its time where no phase of its own shows it (host work between launches); the
    collectives make every step equal.  The rank that waits least while the others wait is the slow one."""
    s = Signals()
    for _ in range(4):  # every phase within the margin: the windows name nobody
        s.add_rank_window(spreads({"forward": {0: 10.0, 1: 10.3}, "backward": {0: 30.0, 1: 22.0},
                                   "backward.comm_wait": {0: 9.0, 1: 0.9}, "period": {0: 45.4, 1: 45.4}}))
    rt = RankSums({0: {"forward": 10.0, "backward": 30.0, "backward.comm_wait": 9.0, "step": 45.4},
                   1: {"forward": 10.3, "backward": 22.0, "backward.comm_wait": 0.9, "step": 45.4}})
    d = diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt)
    found = [f for f in (d, *d.secondary) if f.kind == "RANK_STRAGGLER"]
    assert found, [d.kind, *[f.kind for f in d.secondary]]
    f = found[0]
    assert f.evidence["rank"] == 1 and f.evidence["by"] == "waits" and f.evidence["phase"] is None
    assert f.evidence["margin_ms"] == pytest.approx(8.1)
    assert "rank 1 is the one the others wait for" in f.why and "8.10 ms" in f.why
    assert "no timed phase" in f.next[0]
    # where the slow rank's time shows in the run's totals (its data loading), that phase is named
    rt = RankSums({0: {"data_wait": 0.01, "backward.comm_wait": 20.0}, 1: {"data_wait": 20.1, "backward.comm_wait": 1.0},
                   2: {"data_wait": 0.02, "backward.comm_wait": 19.5}})
    s2 = Signals()
    s2.add_rank_window(spreads({"period": {0: 60.0, 1: 60.0, 2: 60.0}}))
    f = _only(diagnose(totals(**GPU_STEP), s2, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")
    assert f.evidence["rank"] == 1 and f.evidence["phase"] == "data_wait"
    assert f.evidence["margin_ms"] == pytest.approx(18.75)  # the median of the other two's waits, less rank 1's
    assert "data_wait" in f.next[0] and "uneven input pipeline" in f.next[-1]
    # every rank waiting alike (the network, not a rank): no straggler
    rt = RankSums({0: {"backward.comm_wait": 5.0}, 1: {"backward.comm_wait": 5.1}, 2: {"backward.comm_wait": 4.9}})
    d = diagnose(totals(**GPU_STEP), s2, clock="cuda", rank_totals=rt)
    assert all(f.kind != "RANK_STRAGGLER" for f in (d, *d.secondary))
    # one rank waiting much less than one other but not than all: nobody is everyone's straggler
    rt = RankSums({0: {"backward.comm_wait": 9.0}, 1: {"backward.comm_wait": 1.0}, 2: {"backward.comm_wait": 1.1}})
    d = diagnose(totals(**GPU_STEP), s2, clock="cuda", rank_totals=rt)
    assert all(f.kind != "RANK_STRAGGLER" for f in (d, *d.secondary))


def test_a_rank_s_pauses_the_others_wait_for_are_named_with_how_much_and_how_often():
    """Issue 47: rank 0 alone evaluates every 40 steps (nanoGPT's train.py): untimed on rank 0 (paused), it is the
    other ranks' wait in their next all-reduce.  The verdict says which rank, how much, how often, what to do."""
    rt = RankSums({0: {"backward.comm_wait": 0.3}, 1: {"backward.comm_wait": 40.0}}, steps=200)
    rt.steps = {0: 200, 1: 200}
    rt.counts = {0: {"paused_ms": 5 * 1600.0, "pauses": 5.0}, 1: {}}
    s = Signals()
    s.add_rank_window(spreads({"period": {0: 70.0, 1: 70.0}}))
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")
    assert f.evidence["rank"] == 0 and f.evidence["pauses"] == 5
    assert f.evidence["paused_ms_per_step"] == pytest.approx(40.0)
    assert "rank 0 pauses 40.00 ms a step" in f.next[0] and "one every ~40 steps" in f.next[0]
    assert "every rank at the same step" in f.next[0]
    assert not any("no timed phase" in t for t in f.next)


def test_a_pausing_rank_slow_in_a_phase_too_is_named_by_the_phase_with_its_pauses():
    """The rank that evaluates alone is also slowest in its optimizer in every window, by 5 ms (a loaded host; past
    the 5% of period that names a phase), while the others wait 40 ms a step longer for it: the phase names it, as it
    would without the pauses (one rank, one finding, whichever margin is larger: never flipping on noise), and its
    pauses are said with it."""
    def run(optimizer_margin: float) -> object:
        rt = RankSums({0: {"backward.comm_wait": 0.3, "optimizer": 1.2 + optimizer_margin},
                       1: {"backward.comm_wait": 40.0, "optimizer": 1.2}}, steps=200)
        rt.steps = {0: 200, 1: 200}
        rt.counts = {0: {"paused_ms": 5 * 1600.0, "pauses": 5.0}, 1: {}}
        s = Signals()
        for _ in range(4):
            s.add_rank_window(spreads({"optimizer": {0: 1.2 + optimizer_margin, 1: 1.2},
                                       "period": {0: 70.0, 1: 70.0}}))
        return _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")

    for margin in (5.0, 45.0):  # below the others' wait, and above it
        f = run(margin)
        assert f.evidence["rank"] == 0 and f.evidence["by"] == "phase" and f.evidence["phase"] == "optimizer"
        assert f.evidence["pauses"] == 5 and any("rank 0 pauses 40.00 ms a step" in t for t in f.next)
        assert f.evidence["windows"] == 4


def _data_straggler_windows(n: int = 4, period: float = 162.44) -> Signals:
    s = signals({2: 10})  # GPU-bound: the host two steps ahead
    for _ in range(n):  # the 4 x H200 run: rank 1's loader 20 ms a batch slower, every period alike
        s.add_rank_window(spreads({"data_wait": {0: 0.007, 1: 20.127, 2: 0.005, 3: 0.005},
                                   "forward": {0: 45.4, 1: 45.5, 2: 45.4, 3: 45.4},
                                   "period": {0: period, 1: period, 2: period, 3: period}}))
    return s


def _h200_ranks(rank1: dict | None = None, exposed: float | None = 0.008) -> RankSums:
    """Each rank's run totals as rank zero holds them; rank 1's own exposed wait as it sent it (ms a step)."""
    base = {"step": 162.437, "period": 162.445, "between_steps": 0.003, "backward": 104.2, "backward.comm_wait": 0.024}
    rt = RankSums({r: {**base, "data_wait": 0.006, **(rank1 or {} if r == 1 else {})} for r in range(4)})
    rt.sums[1]["data_wait"] = [20.127 * 100, 100]
    rt.steps = {r: 100 for r in range(4)}
    rt.counts = {1: {EXPOSED_WAIT: exposed * 100}} if exposed is not None else {}
    return rt


def test_a_data_straggler_the_device_s_queue_hides_is_no_medium_straggler():
    """4 x H200: rank 1 sleeps 20 ms in its data loading; the queue runs through it, nobody waits in communication.
    Rank zero's verdict says it, as info, with the figures: no fix to make now."""
    d = diagnose(totals(**GPU_STEP), _data_straggler_windows(), clock="cuda", rank_totals=_h200_ranks())
    f = _only(d, "RANK_STRAGGLER")
    assert f.severity == "info" and f.evidence["hidden"] is True and f.evidence["rank"] == 1
    # its idle before its steps over the others' (0.008 - 0.005 ms), and nobody waits longer for it
    assert f.evidence["reaches_ms"] == pytest.approx(0.003, abs=1e-6) and f.evidence["others_wait_longer_ms"] == 0.0
    assert "hidden behind its device's queue" in f.why and "20.12 ms a step above" in f.why
    assert "nothing to gain now" in f.why and "uneven input pipeline" in f.next[-1]
    assert d.kind == "GPU_BOUND" and d.secondary[-1] is f  # said after what holds the run back
    # its own report rules over its run totals: these (a 10 ms gap a step from other windows) would say it reaches
    gap = {"period": 172.445}
    f = _only(diagnose(totals(**GPU_STEP), _data_straggler_windows(), clock="cuda",
                       rank_totals=_h200_ranks(gap)), "RANK_STRAGGLER")
    assert f.severity == "info"
    f = _only(diagnose(totals(**GPU_STEP), _data_straggler_windows(), clock="cuda",
                       rank_totals=_h200_ranks(gap, exposed=None)), "RANK_STRAGGLER")
    assert f.severity == "medium" and f.evidence["reaches_ms"] == pytest.approx(10.0, abs=0.01)
    # on the host clock (gloo on CPUs) the wait is the step's: named as before
    f = _only(diagnose(totals(**GPU_STEP), _data_straggler_windows(), clock="host", rank_totals=_h200_ranks()),
              "RANK_STRAGGLER")
    assert f.severity == "medium" and "hidden" not in f.evidence
    assert f.why == ("rank 1 is the slowest in data_wait in 4 of 4 windows, 20.12 ms a step above the other ranks' "
                     "median (12% of period)")
    # without the ranks' totals nothing tells what reached the devices: named as before
    assert _only(diagnose(totals(**GPU_STEP), _data_straggler_windows(), clock="cuda"),
                 "RANK_STRAGGLER").severity == "medium"


def test_a_data_straggler_whose_wait_reaches_the_devices_is_named():
    """2 GPUs, a smaller model: rank 1's device idles 7.5 ms a step and the other rank waits for it in DDP's
    all-reduce."""
    s = Signals()
    for _ in range(4):
        s.add_rank_window(spreads({"data_wait": {0: 0.01, 1: 20.0}, "period": {0: 58.0, 1: 58.0}}))
    rt = RankSums({0: {"data_wait": 0.01, "step": 58.0, "period": 58.0, "backward.comm_wait": 7.6},
                   1: {"data_wait": 20.0, "step": 50.5, "period": 58.0, "backward.comm_wait": 0.1}})
    rt.steps, rt.counts = {0: 100, 1: 100}, {0: {EXPOSED_WAIT: 0.0}, 1: {EXPOSED_WAIT: 750.0}}
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")
    assert f.severity == "medium" and f.evidence["hidden"] is False and f.evidence["phase"] == "data_wait"
    assert f.evidence["reaches_ms"] == pytest.approx(7.5)
    assert f.evidence["share_of_period"] == pytest.approx(7.5 / 58.0)
    assert "7.50 ms a step of it reaches the devices" in f.why
    assert "the other ranks wait 7.50 ms a step longer for it" in f.why
    # the others' wait alone (its own idle unknown) is enough
    rt.counts = {}
    del rt.sums[1]["period"]
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")
    assert f.severity == "medium" and f.evidence["device_idle_over_others_ms"] is None


def test_a_hidden_data_straggler_leaves_the_rank_slow_in_forward_named():
    s = _data_straggler_windows()
    for _ in range(3):  # rank 2 slow in forward in 3 of 7 windows... and 4 more below
        s.add_rank_window(spreads({"data_wait": {0: 0.007, 1: 20.127, 2: 0.005, 3: 0.005},
                                   "forward": {0: 45.4, 1: 45.5, 2: 60.0, 3: 45.4},
                                   "period": {0: 162.44, 1: 162.44, 2: 162.44, 3: 162.44}}))
    for _ in range(2):
        s.add_rank_window(spreads({"forward": {0: 45.4, 1: 45.5, 2: 60.0, 3: 45.4},
                                   "period": {0: 162.44, 1: 162.44, 2: 162.44, 3: 162.44}}))
    # data_wait: rank 1 in 7 of 9 windows; forward: rank 2 in 5 of 9 (below 60%): nothing else qualifies
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=_h200_ranks()), "RANK_STRAGGLER")
    assert f.severity == "info"
    s.add_rank_window(spreads({"forward": {0: 45.4, 1: 45.5, 2: 60.0, 3: 45.4},
                               "period": {0: 162.44, 1: 162.44, 2: 162.44, 3: 162.44}}))
    # forward: rank 2 in 6 of 10 windows: the straggler, though rank 1 is slowest in data_wait in 7
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=_h200_ranks()), "RANK_STRAGGLER")
    assert (f.evidence["rank"], f.evidence["phase"], f.severity) == (2, "forward", "medium")


def _only(d, kind):
    found = [f for f in (d, *d.secondary) if f.kind == kind]
    assert found, [d.kind, *[f.kind for f in d.secondary]]
    return found[0]


def test_what_the_host_waits_for_comes_first_and_the_rest_is_secondary():
    t = totals(data_wait=30.0, h2d=8.0, forward=10.0, backward=20.0, optimizer=2.0)
    d = diagnose(t, signals({0: 10}, host_step_ms=40.0), clock="cuda")
    assert [d.kind, *[f.kind for f in d.secondary]] == ["INPUT_BOUND", "H2D_BOUND", "HOST_BOUND"]
    text = format_verdict(d)
    assert text.startswith("verdict: INPUT_BOUND") and "also: H2D_BOUND" in text
    assert 3 <= len(text.splitlines()) <= 6
    # a frozen dataclass, as documented
    assert isinstance(d, Diagnosis)
    with pytest.raises(AttributeError):
        d.kind = "X"  # type: ignore[misc]


# -- steps in flight (the Python engine, on a fake clock) ------------------------------------
def test_steps_in_flight_from_the_poll_or_a_query_of_an_older_step():
    clock = FakeClock(lag=1000)  # nothing completes until told
    r = Resolver(clock, max_pending=16, lag=2)
    from phase_timer.timing.recorder import Recorder

    rec = Recorder(clock)
    records = []
    for i in range(6):
        rec.open(i, "forward")
        rec.switch("backward")
        records.append(rec.close())
        r.push(records[-1])
    assert r.poll() == []  # the oldest is not done: the poll stopped there
    q = clock.queries
    assert r.in_flight() == 5 and clock.queries == q  # no query: the poll said it
    clock.wait(records[3].marks[-1])  # the device finished steps 0..3
    assert len(r.poll()) == 4  # max_per_poll
    assert r.in_flight() == 1  # step 4 unfinished; step 5 (the newest) not counted
    clock.wait(records[4].marks[-1])
    q = clock.queries
    assert r.in_flight() == 0
    assert clock.queries - q == 1  # one query, of step 4's last mark; never the newest's


# -- real runs ---------------------------------------------------------------------------
def _plain_run(tmp_path, steps: int, sleep_s: float = 0.0, fail_at: int | None = None, warmup: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, loader(batch_size=4, sleep_s=sleep_s, n=4 * steps), log_dir=str(tmp_path),
                               window=10, warmup_steps=warmup, summary=False)
    try:
        with timer:
            for i, (x, y) in enumerate(timer.loader):
                if fail_at is not None and i == fail_at:
                    raise RuntimeError("planted")
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    except RuntimeError as err:
        assert "planted" in str(err)
    return timer


def _validated(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    jsonschema.validate(data, schema())
    return data


def test_plain_slow_loader_is_input_bound_naming_num_workers(tmp_path, monkeypatch, host_hours):
    import phase_timer.run.boundaries

    monkeypatch.setattr(phase_timer.run.boundaries, "DENSE_SAMPLES", 0)  # no dense start: ...
    monkeypatch.setattr(phase_timer.run.boundaries, "SAMPLE_GAP", (8, 8))  # ... a sampled step every 8th
    timer = _plain_run(tmp_path, steps=40, sleep_s=0.002)  # 4 items x 2 planted hours a batch
    d = timer.diagnosis
    assert d.kind == "INPUT_BOUND"
    assert "num_workers=0" in d.next[0]  # the case it makes of it: tests/diagnosis/test_input_advice.py
    assert d.evidence["loader"]["num_workers"] == 0 and d.evidence["share_of_period"] > 0.5
    data = _validated(timer.summary_path)
    assert timer.summary_path == os.path.join(timer.log_dir, FILE_NAME)
    assert data["diagnosis"]["kind"] == "INPUT_BOUND" and data["door"] == "loop" and not data["interrupted"]
    assert data["steps"]["timed"] == 38 and data["phases"]["data_wait"]["count"] == 38
    assert data["phases"]["data_wait"]["share_of"] == "period"
    assert data["environment"]["loader"]["type"] == "DataLoader" and data["environment"]["precision"] == "32-true"
    assert data["config"]["window"] == 10 and data["config"]["warmup_steps"] == 2
    assert data["steps_in_flight"] is None  # the host clock: nothing in flight, not a zero
    # phase-timer's own cost, timed on the sampled steps: the 10th, 18th, 26th and 34th (timed steps 8, 16,
    # 24 and 32 after the 2 warm-up steps; the 42nd is past the end)
    own = data["own_cost"]
    assert own["samples"] == 4 and own["us_per_step"] > 0
    assert own["share_of_period"] == pytest.approx(own["us_per_step"] / 1e3 / data["phases"]["period"]["mean_ms"])
    assert "phase-timer's own host time" in timer.last_summary
    *lines, files = timer.last_summary.rstrip().splitlines()  # the verdict, then where the files went
    assert lines[-len(format_verdict(d).splitlines()):] == format_verdict(d).splitlines()
    assert files == f"files: TensorBoard values in {timer.log_dir}; summary {timer.summary_path}"


def test_the_verdict_reaches_tensorboard_as_text(tmp_path, host_hours):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    timer = _plain_run(tmp_path, steps=30, sleep_s=0.002)
    acc = EventAccumulator(timer.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("phase_timer/diagnosis/text_summary")  # torch names text tags so (add_text too)
    assert len(events) == 1
    text = events[0].tensor_proto.string_val[0].decode()
    assert text.startswith("verdict: INPUT_BOUND")


def test_a_short_run_is_too_few_steps(tmp_path):
    timer = _plain_run(tmp_path, steps=12)
    assert timer.diagnosis.kind == "TOO_FEW_STEPS"
    assert "10 step(s) timed" in timer.diagnosis.why and "22+" in timer.diagnosis.next[0]


def test_an_exception_still_writes_the_summary_marked_interrupted(tmp_path):
    timer = _plain_run(tmp_path, steps=40, fail_at=25)
    data = _validated(timer.summary_path)
    assert data["interrupted"] is True
    assert data["steps"]["timed"] == 23  # 25 steps closed (fetching batch 25 closed step 24), 2 warm-up
    assert not [f for f in os.listdir(timer.log_dir) if f.endswith(".tmp")]


def test_lightning_slow_loader_is_input_bound(tmp_path, host_hours):
    ns = "lightning.pytorch"
    timer = PhaseTimer(warmup_steps=2, summary=False)
    t = trainer(ns, str(tmp_path), [timer], max_steps=30, log_every_n_steps=10)
    t.fit(module_class(ns)(), loader(batch_size=4, sleep_s=0.002))
    assert timer.diagnosis.kind == "INPUT_BOUND" and "num_workers=0" in timer.diagnosis.next[0]
    data = _validated(timer.summary_path)
    assert os.path.dirname(timer.summary_path) == timer.log_dir  # beside the TensorBoard files
    assert data["door"] == "lightning" and data["environment"]["precision"] == "32-true"
    assert data["environment"]["lightning"] and data["config"]["window"] == 10


def test_lightning_exception_writes_the_summary_marked_interrupted(tmp_path):
    ns = "lightning.pytorch"
    timer = PhaseTimer(warmup_steps=1, summary=False)
    t = trainer(ns, str(tmp_path), [timer], max_steps=40, log_every_n_steps=5)
    with pytest.raises(RuntimeError, match="planted"):
        t.fit(module_class(ns)(fail_at=12), loader())
    data = _validated(timer.summary_path)
    assert data["interrupted"] is True and data["steps"]["timed"] == 11
    assert data["diagnosis"]["kind"] == "TOO_FEW_STEPS"


def test_a_rule_that_fails_warns_and_the_run_keeps_its_numbers(tmp_path, monkeypatch):
    import phase_timer.run.core as core_module

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in a rule")

    monkeypatch.setattr(core_module, "diagnose", broken)
    with pytest.warns(RuntimeWarning, match="could not diagnose"):
        timer = _plain_run(tmp_path, steps=25)
    assert timer.diagnosis is None and timer.totals.steps == 23
    assert not os.path.exists(os.path.join(timer.log_dir, FILE_NAME)) or _validated(os.path.join(timer.log_dir, FILE_NAME))


def test_steps_in_flight_is_logged_per_window_from_the_counted_closes():
    from phase_timer.run.boundaries import FLIGHT_DENSE_STEPS, FLIGHT_EVERY, Boundaries
    from phase_timer.run.core import TimingCore
    from phase_timer.outputs.tags import IN_FLIGHT_TAG

    class Sink:
        def __init__(self):
            self.rows = []

        def write(self, step, scalars):
            self.rows.append((step, scalars))

        def flush(self):
            pass

        def close(self):
            pass

    sink = Sink()
    clock = FakeClock(lag=1)  # each mark is done only after a poll has found it not done: the device behind
    core = TimingCore(clock, [sink], window=10, warmup_steps=0, max_pending=64)
    bounds = Boundaries(core)
    for i in range(100):
        bounds.fetch()
        bounds.batch(i, 0.1)
        bounds.copied()
        bounds.backward_start()
        bounds.backward_end()
        bounds.optimizer_start()
        bounds.step_end()
    bounds.finish()
    core.finish()
    windows = [s for _, s in sink.rows if "phase_timer/window_steps" in s]
    counted = sum(core.signals.flight.values())
    # timed steps 2, 4, ..., 32, then 48, 64, 80, 96 (the 100th closes at finish)
    assert counted == FLIGHT_DENSE_STEPS // 2 + (100 - FLIGHT_DENSE_STEPS) // FLIGHT_EVERY
    logged = [s[IN_FLIGHT_TAG] for s in windows if IN_FLIGHT_TAG in s]
    assert len(windows) == 10 and core.skipped == 0
    assert logged and any(v >= 1 for v in logged)  # the fake device lags: steps are in flight
    assert len(logged) < len(windows)  # no count in 97-100: a window without a count has no value, not 0


def test_the_schema_names_every_kind_the_rules_give():
    from phase_timer.diagnosis import KINDS

    assert schema()["$defs"]["finding"]["properties"]["kind"]["enum"] == list(KINDS)


# -- the verdict's sampling schedule (issue 25): dense at first, sparse later ---------------------
def _schedule(steps: int, warmup: int, seed: int, monkeypatch) -> tuple[list[int], list[int], TimingCore]:
    """``steps`` steps through real boundaries on a lagging fake device: the timed steps (1-based, after
    the warm-up) that were sampled, and those whose close counted the steps in flight."""
    import random

    import phase_timer.run.boundaries as b

    seeded = random.Random
    monkeypatch.setattr(b.random, "Random", lambda: seeded(seed))
    core = TimingCore(FakeClock(lag=1), [], window=10, warmup_steps=warmup, max_pending=64)
    bounds = b.Boundaries(core)
    sampled: list[int] = []
    counted: list[int] = []
    close = core.close

    def spy_close(flight: bool = False) -> None:  # which closes count the steps in flight
        if flight:
            counted.append(bounds.steps - warmup)
        close(flight)

    core.close = spy_close
    for _ in range(steps):
        bounds.fetch()
        bounds.batch()
        if isinstance(bounds, b._SampledBoundaries):
            sampled.append(bounds.steps + 1 - warmup)
        bounds.copied()
        bounds.backward_start()
        bounds.backward_end()
        bounds.optimizer_start()
        bounds.step_end()
    bounds.finish()
    core.finish()
    # every sampled step that closed gave one sample of each kind
    assert len(core.signals.own_ns) == len(core.signals.host_step_ms) == len(sampled)
    return sampled, counted, core


@pytest.mark.parametrize("warmup", [0, 5])
@pytest.mark.parametrize("seed", range(10))
def test_the_verdicts_samples_come_densely_first_then_sparsely(warmup, seed, monkeypatch):
    from phase_timer.run.boundaries import DENSE_GAP, DENSE_SAMPLES, FLIGHT_DENSE_STEPS, FLIGHT_EVERY, SAMPLE_GAP
    from phase_timer.diagnosis import MIN_FLIGHT_SAMPLES, MIN_STEPS

    sampled, counted, core = _schedule(1000 + warmup, warmup, seed, monkeypatch)
    gaps = [b - a for a, b in zip([0, *sampled], sampled)]
    # sampled: timed steps only, the first DENSE_SAMPLES 2-4 apart, then 48-144 apart
    assert all(DENSE_GAP[0] <= g <= DENSE_GAP[1] for g in gaps[:DENSE_SAMPLES])
    assert all(SAMPLE_GAP[0] <= g <= SAMPLE_GAP[1] for g in gaps[DENSE_SAMPLES:])
    by = {n: sum(t <= n for t in sampled) for n in (20, 50, 100, 1000)}
    assert by[20] >= 5 and by[50] == DENSE_SAMPLES and DENSE_SAMPLES <= by[100] <= DENSE_SAMPLES + 2
    assert by[1000] <= DENSE_SAMPLES + (1000 - 4 * DENSE_SAMPLES) // SAMPLE_GAP[0] + 1
    # in flight: timed steps 2, 4, ..., 32, then every 16th
    assert counted == [*range(2, FLIGHT_DENSE_STEPS + 1, 2), *range(FLIGHT_DENSE_STEPS + FLIGHT_EVERY, 1000, FLIGHT_EVERY)]
    assert sum(t <= MIN_STEPS for t in counted) == 10 >= MIN_FLIGHT_SAMPLES
    assert sum(core.signals.flight.values()) == len(counted)
    assert sum(n * k for n, k in core.signals.flight.items()) > 0  # the lagging device: some in flight
    # each sampled step asks at its 4 marked boundaries (forward, backward, optimizer, end) whether the
    # device has begun the span before; the other steps never ask
    assert 4 * (len(sampled) - 1) <= core.signals.behind_checked <= 4 * len(sampled)


def test_a_short_gpu_bound_run_that_reads_the_loss_every_step_is_gpu_bound(monkeypatch):
    """20 timed steps whose device work (12 ms) far outlasts the host's time to issue it (~µs), the
    host waiting for the device between steps (a ``loss.item()`` after the optimizer step): GPU_BOUND,
    with the note that the host never ran ahead."""
    import time

    from phase_timer.run.boundaries import FORWARD, Boundaries

    host = [10**9]

    def perf_counter_ns() -> int:  # a virtual host clock: every reading 1 µs later
        host[0] += 1000
        return host[0]

    monkeypatch.setattr(time, "perf_counter_ns", perf_counter_ns)
    clock = FakeClock(tick_ms=3.0)  # each mark 3 ms of device time after the one before
    core = TimingCore(clock, [], window=10, warmup_steps=5, max_pending=64)
    bounds = Boundaries(core)
    for _ in range(25):
        bounds.fetch()
        bounds.batch(first=FORWARD)
        bounds.backward_start()
        bounds.backward_end()
        bounds.optimizer_start()
        bounds.step_end()
        host[0] += 12_000_000  # the loss read: the host waits for the device's 12 ms
    bounds.finish()
    core.finish()
    d = core.diagnosis
    assert core.totals.steps == 20 and len(core.signals.host_step_ms) >= 4
    assert d.kind == "GPU_BOUND", (d.why, d.evidence)
    assert "never got a step ahead" in d.why and d.evidence["device_over_host_step"] > 100


@pytest.mark.parametrize("loader", [True, False])
def test_a_plain_loop_is_sampled_with_or_without_a_loader(tmp_path, loader):
    """Without a loader the forward both closes a step and begins the next: the sample still counts
    (it did not, so a nanoGPT-style loop never had a host step time, however long it ran)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(25)]
    timer = phase_timer.attach(model, opt, data if loader else None, log_dir=str(tmp_path), summary=False, warmup_steps=5)
    core = timer.core
    with timer:
        for x, y in (timer.loader if loader else data):
            for _ in range(2):  # two micro-batches a step
                nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    signals = core.signals
    assert timer.totals.steps == 20
    assert len(signals.host_step_ms) == len(signals.own_ns) >= 5 and min(signals.host_step_ms) > 0


def test_a_few_slow_steps_do_not_make_a_host_bound_run_gpu_bound():
    """The device's step against the host's time to issue it, as medians: 5 slow steps in 100 (a logging
    step, a collection) lift the device's mean step 27% over the host's, and once read GPU_BOUND."""
    t = RunTotals()
    t.add_window(100, {"forward": [1.0] * 100, "backward": [1.0] * 95 + [13.0] * 5, "optimizer": [0.3] * 100,
                       "step": [2.3] * 95 + [14.3] * 5, "period": [2.4] * 95 + [14.4] * 5})
    s = signals({0: 10}, host_step_ms=2.3)
    assert t.phases["step"].mean / 2.3 > 1.25  # what the means said
    d = diagnose(t, s, clock="cuda")
    assert d.kind == "HOST_BOUND" and d.evidence["device_over_host_step"] == pytest.approx(1.0, abs=0.02)


def test_a_data_straggler_whose_own_device_never_idled_is_not_credited_with_the_others_wait():
    """Rank 1's loader is 20 ms slower, its own device's idle before its steps is known and ~0, and the other rank
    waits 7.5 ms longer in its collectives (for something else: the lag its device never felt cannot be it): the
    data wait is not named as reaching the devices.  And what is said to reach them is never more than the lag."""
    s = Signals()
    for _ in range(4):
        s.add_rank_window(spreads({"data_wait": {0: 0.01, 1: 20.0}, "period": {0: 58.0, 1: 58.0}}))
    rt = RankSums({0: {"data_wait": 0.01, "step": 58.0, "period": 58.0, "backward.comm_wait": 7.6},
                   1: {"data_wait": 20.0, "step": 50.5, "period": 58.0, "backward.comm_wait": 0.1}})
    rt.steps, rt.counts = {0: 100, 1: 100}, {0: {EXPOSED_WAIT: 0.0}, 1: {EXPOSED_WAIT: 0.3}}
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")
    # named by the others' waits (what they wait for), not as its data wait reaching the devices
    assert f.evidence["by"] == "waits" and f.evidence["rank"] == 1 and "reaches_ms" not in f.evidence
    assert "reaches the devices" not in f.why
    # its device idles 30 ms a step over the others' where its lag is 20: 20 reach the devices, not 30
    rt.counts = {0: {EXPOSED_WAIT: 0.0}, 1: {EXPOSED_WAIT: 3000.0}}
    f = _only(diagnose(totals(**GPU_STEP), s, clock="cuda", rank_totals=rt), "RANK_STRAGGLER")
    assert f.severity == "high" and f.evidence["reaches_ms"] == pytest.approx(19.99)


def test_a_fetch_inside_the_step_is_taken_whole_on_a_device_clock():
    """Lightning's ``training_step(self, dataloader_iter)``: the step's span holds its fetch, so the device's idle
    over it is in ``forward`` and period - step says nothing of it: the whole wait is taken as reaching the device."""
    d = diagnose(totals(**HIDDEN), Signals(), clock="cuda", context={"fetch_in_step": True})
    f = _only(d, "INPUT_BOUND")
    assert f.severity == "medium" and "hidden" not in f.evidence and "20.13 ms a step" in f.why
    s = Signals()
    summary = {"data_wait": {"mean": 20.0}, "step": {"mean": 160.0}, "period": {"mean": 160.0}}
    assert s.add_wait(10, summary) == 0.0  # period - step: nothing between the steps
    assert s.add_wait(10, summary, whole=True) == pytest.approx(200.0)  # the whole wait, ms over the 10 steps
