"""The core on the CPU with a fake clock: recorder, resolver, statistics, sinks."""

from __future__ import annotations

import math
import random
import warnings

import pytest

from phase_timer.run.core import TimingCore
from phase_timer.timing.engine import POLL_EVERY
from phase_timer.outputs.table import format_summary
from phase_timer.outputs.tags import SKIPPED_TAG, WINDOW_STEPS_TAG, window_tag
from phase_timer.timing.recorder import Recorder
from phase_timer.timing.resolver import Resolver
from phase_timer.timing import stats
from phase_timer.timing.stats import PhaseTotals, percentile, summarize
from tests.fakes import FakeClock, ListSink


def run_step(core: TimingCore, step: int, phases: list[str]) -> None:
    core.begin_step(step, phases[0])
    for p in phases[1:]:
        core.phase(p)
    core.close()


# -- recorder -----------------------------------------------------------------------
def test_spans_are_contiguous_and_add_up():
    clock = FakeClock(tick_ms=2.0)
    rec = Recorder(clock)
    rec.open(7, "h2d")
    for p in ("forward", "backward", "optimizer"):
        rec.switch(p)
    record = rec.close()
    assert record.step == 7
    assert record.labels == ["h2d", "forward", "backward", "optimizer"]
    assert len(record.marks) == 5


def test_switch_to_running_phase_takes_no_mark_and_repeated_phases_sum():
    clock = FakeClock(tick_ms=1.0)
    resolver = Resolver(clock, lag=0, max_pending=8)
    rec = Recorder(clock)
    rec.open(0, "forward")
    rec.switch("forward")  # no-op
    rec.switch("backward")
    rec.switch("forward")  # second micro-batch
    rec.switch("backward")
    rec.relabel("idle")
    rec.switch("optimizer")
    resolver.push(rec.close())
    (times,) = resolver.poll()
    assert times.ms["forward"] == 2.0
    assert times.ms["backward"] == 1.0  # second backward span was relabelled idle
    assert times.ms["idle"] == 1.0
    assert times.ms["step"] == pytest.approx(sum(v for k, v in times.ms.items() if k != "step"))
    assert clock.created == 6  # the no-op switch took no mark


def test_calls_outside_a_record_do_nothing():
    clock = FakeClock()
    rec = Recorder(clock)
    rec.switch("forward")
    rec.relabel("idle")
    rec.add_host("data_wait", 3.0)
    assert rec.close() is None
    assert clock.created == 0


# -- resolver -----------------------------------------------------------------------
def _records(clock: FakeClock, n: int, start: int = 0):
    rec = Recorder(clock)
    out = []
    for s in range(start, start + n):
        rec.open(s, "forward")
        rec.switch("backward")
        out.append(rec.close())
    return out


def test_poll_never_waits_and_resolves_in_fifo_order():
    clock = FakeClock(lag=3)
    resolver = Resolver(clock, lag=0, max_pending=100, max_per_poll=100)
    for r in _records(clock, 10):
        resolver.push(r)
    seen = []
    for _ in range(50):  # each record needs its 3 unfinished polls, then one more
        seen += [t.step for t in resolver.poll()]
    assert clock.waits == 0
    assert seen == list(range(10))  # in order, none lost, none twice
    assert len(resolver) == 0


def test_poll_stops_at_first_unfinished_record():
    clock = FakeClock(lag=0)
    resolver = Resolver(clock, lag=0, max_pending=10, max_per_poll=10)
    first, second, third = _records(clock, 3)
    third.epoch = 1  # on another stream: its being done says nothing of the others
    second.marks[-1].polls_left = 5  # the device has not reached the middle record
    for r in (first, second, third):
        resolver.push(r)
    assert [t.step for t in resolver.poll()] == [0]
    assert len(resolver) == 2  # the third waits behind the second, even though it is done
    for _ in range(5):
        resolver.poll()
    assert len(resolver) == 0


def test_one_query_answers_for_records_on_one_stream():
    # One stream completes in order: the newest record it may ask being done, all before it are.
    clock = FakeClock(lag=0)
    resolver = Resolver(clock, lag=1, max_pending=10, max_per_poll=10)
    for r in _records(clock, 6):
        resolver.push(r)
    assert [t.step for t in resolver.poll()] == [0, 1, 2, 3, 4] and clock.queries == 1
    # Not done yet: each is asked, oldest first, up to the first not done.
    records = _records(clock, 4, start=6)
    records[2].marks[-1].polls_left = 2  # step 8: not done at its first two queries
    for r in records:
        resolver.push(r)
    queries = clock.queries
    assert [t.step for t in resolver.poll()] == [5, 6, 7]
    assert clock.queries - queries == 5  # step 8 (the newest it may ask), then 5, 6, 7 and 8 again
    assert [t.step for t in resolver.poll()] == [8]  # step 9 is the newest: never asked (lag 1)


def test_the_newest_records_are_never_queried():
    # Querying an event just recorded makes the driver flush its batched launches:
    # the resolver leaves the newest `lag` records alone until more arrive.
    clock = FakeClock()
    resolver = Resolver(clock, lag=2, max_pending=100, max_per_poll=100)
    records = _records(clock, 3)
    for r in records[:2]:
        resolver.push(r)
    assert resolver.poll() == [] and clock.queries == 0
    resolver.push(records[2])
    assert [t.step for t in resolver.poll()] == [0]
    assert [t.step for t in resolver.drain()] == [1, 2]


def test_poll_is_bounded_per_call():
    clock = FakeClock()
    resolver = Resolver(clock, lag=0, max_pending=100, max_per_poll=4)
    for r in _records(clock, 10):
        resolver.push(r)
    assert [len(resolver.poll()) for _ in range(4)] == [4, 4, 2, 0]


def test_drain_waits_once_per_record_and_resolves_everything():
    clock = FakeClock(lag=10**6)
    resolver = Resolver(clock, lag=0, max_pending=10)
    for r in _records(clock, 5):
        resolver.push(r)
    assert resolver.poll() == []
    out = resolver.drain()
    assert [t.step for t in out] == list(range(5))
    assert clock.waits == 5  # one wait per record: the last mark of one stream


def test_multi_stream_record_checks_every_mark():
    clock = FakeClock()
    rec = Recorder(clock)
    rec.open(0, "forward")
    clock.stream_epoch += 1  # marks went to another stream mid-record
    rec.switch("backward")
    record = rec.close()
    assert not record.single_stream
    record.marks[0].polls_left = 2  # the first stream lags behind the second
    resolver = Resolver(clock, lag=0, max_pending=4)
    resolver.push(record)
    assert resolver.poll() == [] and resolver.poll() == []
    assert len(resolver.poll()) == 1


def test_marks_go_back_to_the_pool():
    clock = FakeClock()
    resolver = Resolver(clock, lag=0, max_pending=4)
    for r in _records(clock, 3):
        resolver.push(r)
    resolver.poll()
    # The last record's last mark is kept for the next one's period; the end of training gives it back.
    assert clock.live_marks == 1
    resolver.drain()
    assert clock.live_marks == 0


# -- core ---------------------------------------------------------------------------
PHASES = ["h2d", "forward", "backward", "optimizer"]


def test_warmup_steps_are_not_recorded():
    clock = FakeClock()
    sink = ListSink()
    core = TimingCore(clock, [sink], window=10, warmup_steps=3, max_pending=8)
    for s in range(10):
        run_step(core, s, PHASES)
    core.finish()
    assert core.totals.steps == 7
    assert clock.created == 7 * 5


def test_windows_align_with_the_logging_interval_and_flush_at_the_end():
    clock = FakeClock(tick_ms=1.0)
    sink = ListSink()
    core = TimingCore(clock, [sink], window=5, warmup_steps=0, max_pending=8, poll_lag=0)
    for s in range(2 * POLL_EVERY + 2):  # polled at closes 8 and 16: steps 0-15 resolved
        run_step(core, s, PHASES)
    assert [step for step, _ in sink.writes] == [4, 9, 14]  # as Lightning logs at (s+1) % 5 == 0
    core.finish()
    assert [step for step, _ in sink.writes] == [4, 9, 14, 17]  # the last, partial window is flushed
    scalars = sink.writes[0][1]
    assert scalars[WINDOW_STEPS_TAG] == 5.0 and sink.writes[-1][1][WINDOW_STEPS_TAG] == 3.0
    assert scalars[window_tag("forward", "mean")] == 1.0
    assert scalars[window_tag("step", "max")] == 4.0
    assert sink.closed


def test_lagging_device_delays_output_but_loses_nothing():
    clock = FakeClock(lag=7)
    sink = ListSink()
    core = TimingCore(clock, [sink], window=1, warmup_steps=0, max_pending=64, per_step=True)
    for s in range(30):
        run_step(core, s, PHASES)
    written_before_end = len(sink.writes)
    core.finish()
    steps = [step for step, sc in sink.writes if "phase_time_step/step_ms" in sc]
    assert written_before_end < 60
    assert steps == list(range(30))
    assert clock.waits > 0  # the drain waited, at the end only


def test_full_resolver_skips_steps_and_says_so():
    clock = FakeClock(lag=10**6)  # the device never catches up until the drain
    sink = ListSink()
    core = TimingCore(clock, [sink], window=100, warmup_steps=0, max_pending=4)
    with pytest.warns(RuntimeWarning, match="max_pending"):
        for s in range(10):
            run_step(core, s, PHASES)
    assert core.skipped == 6
    assert clock.live_marks <= 4 * 5  # bounded
    core.finish()
    assert core.totals.steps == 4
    (_, scalars), = sink.writes
    assert scalars[SKIPPED_TAG] == 6.0


def test_host_phases_and_period():
    clock = FakeClock()
    core = TimingCore(clock, [], window=10, warmup_steps=0, max_pending=8, per_step=False)
    for s in range(3):
        core.begin_step(s, "forward")
        core.add_host("data_wait", 2.5)
        core.close()
    core.finish()
    assert core.totals.phases["data_wait"].mean == 2.5
    assert core.totals.phases["period"].count == 2  # the first step has no previous end: absent, not 0


def test_pause_removes_time_from_period(monkeypatch):
    now = [0]
    monkeypatch.setattr("phase_timer.run.core.time.perf_counter_ns", lambda: now[0])
    # (device spans of 0.1 ms: the host's period, not the record's own time, is the larger)
    core = TimingCore(FakeClock(tick_ms=0.1), [], window=10, warmup_steps=0, max_pending=8)
    run_step(core, 0, PHASES)
    now[0] += 1_000_000
    core.pause()  # outside a record: the next one's period is the host's
    now[0] += 50_000_000  # validation
    core.resume()
    now[0] += 2_000_000
    run_step(core, 1, PHASES)
    core.finish()
    assert core.totals.phases["period"].mean == pytest.approx(3.0)


def test_finish_discards_a_half_step_and_is_idempotent():
    clock = FakeClock()
    sink = ListSink()
    core = TimingCore(clock, [sink], window=10, warmup_steps=0, max_pending=8)
    run_step(core, 0, PHASES)
    core.begin_step(1, "h2d")
    core.phase("forward")  # an exception strikes here
    core.finish()
    core.finish()
    assert core.totals.steps == 1
    assert len(sink.writes) == 1
    assert clock.live_marks == 0
    core.begin_step(2, "h2d")  # after finish: ignored
    assert not core.recording


class Exploding(ListSink):
    def write(self, step, scalars):
        raise OSError("disk full")


def test_a_failing_sink_warns_once_and_others_still_get_data():
    good = ListSink()
    core = TimingCore(FakeClock(), [Exploding(), good], window=1, warmup_steps=0, max_pending=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(5):
            run_step(core, s, PHASES)
        core.finish()
    assert len([w for w in caught if "disk full" in str(w.message)]) == 1
    assert len(good.writes) == 5


# -- statistics ---------------------------------------------------------------------
def test_window_statistics_match_numpy_definitions():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    values = [rng.lognormvariate(0, 1) for _ in range(101)]
    s = summarize(values)
    assert s["mean"] == pytest.approx(np.mean(values))
    assert s["p50"] == pytest.approx(np.percentile(values, 50))
    assert s["p90"] == pytest.approx(np.percentile(values, 90))
    assert s["max"] == max(values)
    assert percentile([3.0], 90) == 3.0


def test_run_totals_percentiles_within_half_a_percent_and_memory_bounded():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    totals = PhaseTotals()
    values = [rng.uniform(0.5, 40.0) for _ in range(50_000)]
    for v in values:
        totals.add(v)
    for q in (50, 90):
        assert totals.quantile(q) == pytest.approx(np.percentile(values, q), rel=0.006)
    assert totals.mean == pytest.approx(np.mean(values))
    assert totals.max == max(values)
    assert len(totals._buckets) < 500  # ~log(80)/log(1.01) buckets, whatever the step count


def test_zero_durations_are_counted():
    totals = PhaseTotals()
    for v in (0.0, 0.0, 1.0):
        totals.add(v)
    assert totals.quantile(50) == 0.0 and totals.max == 1.0 and math.isclose(totals.mean, 1 / 3)


def test_summary_table_lists_phases_in_order_with_shares():
    core = TimingCore(FakeClock(), [], window=10, warmup_steps=0, max_pending=8)
    for s in range(4):
        core.begin_step(s, "h2d")
        core.add_host("data_wait", 1.0)
        for p in PHASES[1:]:
            core.phase(p)
        core.close()
    core.finish()
    table = format_summary(core.totals, clock="cuda")
    lines = [ln.split()[0] for ln in table.splitlines()[4:-2]]
    assert lines == ["data_wait", "h2d", "forward", "backward", "optimizer", "step", "period"]
    assert "25.0%" in table  # four equal device phases


def test_share_of_a_phase_absent_from_some_steps_is_time_weighted():
    core = TimingCore(FakeClock(tick_ms=1.0), [], window=10, warmup_steps=0, max_pending=8)
    run_step(core, 0, ["forward", "idle", "forward", "optimizer"])  # 4 ms, 1 ms idle
    for s in range(1, 4):
        run_step(core, s, ["forward", "optimizer"])  # 2 ms each
    core.finish()
    idle_row = next(ln for ln in format_summary(core.totals, clock="cuda").splitlines() if ln.startswith("idle"))
    assert idle_row.endswith("10.0%")  # 1 ms of 10 ms, not its 1 ms mean over a 2.5 ms mean step


def test_nvtx_ranges_mirror_the_spans():
    from phase_timer.timing.recorder import NvtxRecorder

    calls = []
    clock = FakeClock()
    rec = NvtxRecorder(clock, push=lambda name: calls.append(("push", name)), pop=lambda: calls.append(("pop",)))
    rec.open(0, "h2d")
    rec.switch("forward")
    rec.switch("forward")  # no new span, no new range
    rec.relabel("idle")
    rec.close()
    rec.switch("backward")  # outside a record: nothing
    assert calls == [("push", "h2d"), ("pop",), ("push", "forward"), ("pop",), ("push", "idle"), ("pop",)]


def test_nvtx_off_by_default_costs_nothing():
    from phase_timer.timing.recorder import NvtxRecorder

    core = TimingCore(FakeClock(), [], window=10, warmup_steps=0, max_pending=8)
    assert not isinstance(core._engine._recorder, NvtxRecorder)
    assert core.phase == core._engine.switch  # the bound method itself: no wrapper frame


@pytest.mark.skipif(stats._native_buckets is None, reason="the C extension is not built")
def test_c_buckets_equal_the_python_ones():
    # Each value's bucket from its own log, the same in C and Python: wide and tight windows, zeros,
    # negatives (a clock that stepped back), ties and values on a bucket's edge.
    rng = random.Random(5)
    edges = [stats._GROWTH ** k for k in range(-300, 300, 7)]
    for trial in range(300):
        n = rng.choice([1, 2, 50, 200])
        kind = trial % 4
        if kind == 0:
            values = [rng.lognormvariate(0, 3) for _ in range(n)]
        elif kind == 1:
            values = [2.5 * (1 + rng.gauss(0, 0.02)) for _ in range(n)]
        elif kind == 2:
            values = [rng.choice([0.0, -0.001, 1.0, 1.0]) + rng.choice([0.0, 1e-9]) for _ in range(n)]
        else:
            values = [rng.choice(edges) for _ in range(n)]
        values.sort()
        assert stats._bucket_counts(values) == stats._bucket_counts_py(values), values
        # A window's one pass (sum, median, 90th percentile and its buckets added in) equals Python's.
        into_c, into_py = {3: 2, -(10**9): 1}, {3: 2, -(10**9): 1}
        assert stats._sorted_stats(values, into_c) == stats._sorted_stats_py(values, into_py), values
        assert into_c == into_py
        got = stats._sorted_stats_py(values, {})
        assert got[1:] == (stats.percentile(values, 50), stats.percentile(values, 90))
        assert got[0] == pytest.approx(sum(values), rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError):
        stats._bucket_counts([1.0, math.nan])
    with pytest.raises(TypeError):
        stats._sorted_stats([], {})


def test_a_sorted_window_adds_up_as_any_window_and_summarizes_as_summarize():
    rng = random.Random(9)
    a, b = stats.RunTotals(), stats.RunTotals()
    for _ in range(20):
        columns = {p: sorted(rng.lognormvariate(0, 1) for _ in range(rng.randint(1, 60))) for p in ("forward", "step")}
        summary = a.add_sorted_window(len(columns["step"]), {p: list(v) for p, v in columns.items()})
        b.add_window(len(columns["step"]), columns)
        want = stats.summarize_columns(columns)
        assert summary.keys() == want.keys()
        for p in want:
            assert summary[p] == pytest.approx(want[p], rel=1e-12)
    assert a.steps == b.steps
    for p, t in b.phases.items():
        u = a.phases[p]
        assert (u.count, u.min, u.max, u._buckets) == (t.count, t.min, t.max, t._buckets)
        assert u.total == pytest.approx(t.total, rel=1e-12)
