"""The exchange between ranks on its own, through a real c10d TCPStore in this process.

Each simulated rank has its own RankExchange and its own store connection, as on a
real job; the real multi-process runs are in test_distributed.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from phase_timer.outputs.tags import RANKS_TAG, rank_scalars
from phase_timer.distributed.rank_view import format_rank_table
from phase_timer.distributed.rank_node import leaf_body
from phase_timer.distributed.ranks import STALE_EXCHANGES, RankExchange, RankTotals, RankWindow, _json, decode, encode


def sums(**ms: float) -> dict[str, list[float]]:
    """A window of 5 steps whose every value of a phase is ``ms[phase]``."""
    return {p: [v] * 5 for p, v in ms.items()}


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    yield server


def ranks(store, n: int, namespace: str = "phase_timer/test") -> list[RankExchange]:
    return [RankExchange(store.clone(), r, n, namespace) for r in range(n)]


def run_windows(exchanges: list[RankExchange], windows: int, ms: dict[int, float], *, stop_after: dict[int, int] | None = None):
    """Each rank writes ``windows`` windows (rank r's forward: ms[r]) and exchanges after each, in lockstep."""
    written: list[RankWindow] = []
    for w in range(windows):
        for ex in exchanges:
            if stop_after and w >= stop_after.get(ex.rank, windows):
                continue
            ex.add(w, 5 * w + 4, 5, sums(forward=ms[ex.rank], step=2 * ms[ex.rank]))
            written += ex.exchange()
        for ex in exchanges:  # a real job leaves seconds between windows: the threads keep up
            ex._sent_event.wait(5)
    return written


def test_frames_round_trip_and_a_partial_one_waits() -> None:
    windows = [[3, 19, 5, {"forward": [10.5, 5], "step": [50.25, 5]}], [4, 24, 5, {"forward": [1.0, 5]}]]
    a = encode(2, _json(windows), final=True)
    b = encode(7, b"[]")
    frames, end = decode(a + b)
    assert frames == [(2, True, windows), (7, False, [])] and end == len(a + b)
    frames, end = decode(a + b[:-1])  # the second frame is not complete yet
    assert frames == [(2, True, windows)] and end == len(a)
    assert decode(a, parse=False)[0] == [(2, True, _json(windows))]


def test_every_rank_is_written_and_the_store_is_left_clean(store) -> None:
    exchanges = ranks(store, 4)
    before = store.num_keys()
    written = run_windows(exchanges, 6, {0: 1.0, 1: 3.0, 2: 2.0, 3: 1.5})
    for ex in reversed(exchanges):  # rank 0 last, as the slowest to finish
        written += ex.finish(timeout_s=5)
    assert [w.key for w in written] == list(range(6))
    assert all(w.ranks == 4 for w in written)
    assert all(w.stats("forward")["slowest_rank"] == 1.0 for w in written)
    assert exchanges[0].totals.mean(2, "forward") == pytest.approx(2.0)
    assert exchanges[0].finished == {0, 1, 2, 3}
    exchanges[0]._thread.join(5)  # rank 0's thread deletes what is left, then stops
    assert store.num_keys() == before  # every exchange's keys deleted


def test_a_rank_that_stops_reporting_is_named_and_the_others_go_on(store, monkeypatch) -> None:
    monkeypatch.setattr("phase_timer.distributed.rank_reader.STALE_S", 0.0)  # exchanges are milliseconds apart here
    exchanges = ranks(store, 3)
    with pytest.warns(RuntimeWarning, match="rank 2 has not reported"):
        written = run_windows(exchanges, 2 * STALE_EXCHANGES + 4, {0: 1.0, 1: 2.0, 2: 3.0}, stop_after={2: 2})
    exchanges[1].finish(timeout_s=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written += exchanges[0].finish(timeout_s=1)
    assert not [w for w in caught if "no final report" in str(w.message)]  # a gone rank is not waited for
    assert 2 in exchanges[0].gone
    keys = [w.key for w in written]
    assert keys == sorted(set(keys)) and keys[-1] == 2 * STALE_EXCHANGES + 3  # windows kept flowing
    assert written[-1].ranks == 2


def test_ranks_that_ran_fewer_windows_do_not_hold_the_end(store) -> None:
    exchanges = ranks(store, 3)
    run_windows(exchanges[1:2], 3, {1: 2.0})  # rank 1 ran 3 windows ...
    exchanges[1].finish(timeout_s=5)  # ... and finished
    run_windows([exchanges[0], exchanges[2]], 6, {0: 1.0, 2: 3.0})
    exchanges[2].finish(timeout_s=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exchanges[0].finish(timeout_s=20)
    assert exchanges[0].finished == {0, 1, 2}
    assert not [w for w in caught if "no final report" in str(w.message)]  # no wait to the deadline


def test_a_rank_that_ran_more_windows_is_read_at_the_end(store) -> None:
    # Rank 1 made 6 exchanges and its final report went to a 7th; rank 0 made 3.  At
    # its end rank 0 reads past its own exchanges: rank 1's last windows are written.
    exchanges = ranks(store, 2)
    run_windows(exchanges[1:], 6, {1: 2.0})
    exchanges[1].finish(timeout_s=5)
    written = run_windows(exchanges[:1], 3, {0: 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written += exchanges[0].finish(timeout_s=5)
    assert not caught, [str(w.message) for w in caught]
    assert exchanges[0].finished == {0, 1}
    assert [(w.key, w.ranks) for w in written] == [(0, 2), (1, 2), (2, 2), (3, 1), (4, 1), (5, 1)]
    assert exchanges[0].totals.steps == {0: 15, 1: 30}


class SlowStore:
    """A store connection whose appends take ``delay_s``: the final report is still on its way."""

    def __init__(self, store, delay_s: float) -> None:
        self._store, self.delay_s = store, delay_s

    def append(self, *args):
        time.sleep(self.delay_s)
        return self._store.append(*args)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_finish_returns_once_the_final_report_is_in_the_store(store) -> None:
    # After finish() the process may make a blocking store request of its own (a
    # barrier, a new group): a send still queued behind it would leave rank 0 waiting.
    ex = RankExchange(SlowStore(store.clone(), 0.1), 1, 2, "phase_timer/slow")
    for w in range(3):
        ex.add(w, 5 * w + 4, 5, sums(forward=1.0))
        ex.exchange()  # three sends queued, 0.1 s each
    ex.finish(timeout_s=10)
    assert [int(store.add(f"phase_timer/slow/1.0/{k}/n", 0)) for k in range(4)] == [1, 1, 1, 1]
    frames, _ = decode(store.get("phase_timer/slow/1.0/3"))
    assert frames == [(1, True, [])]


class HookedStore:
    """Rank zero's store connection, running ``before(key)`` ahead of each counter read."""

    def __init__(self, store, before) -> None:
        self._store, self._before = store, before

    def add(self, key, value):
        if value == 0:
            self._before(key)
        return self._store.add(key, value)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def send_by_hand(store, ns: str, k: int, rank: int, window: int | None, *, final: bool = False) -> None:
    """What rank ``rank``'s thread sends for exchange ``k`` to the one group of a small job: its window
    ``window`` (forward 3 ms), and its run totals."""
    body = b"[]" if window is None else leaf_body(
        [_json([window, 5 * window + 4, 5, {"forward": [15.0, 5]}])],
        _json({"s": 5 * (window + 1), "p": {"forward": [15.0 * (window + 1), 5 * (window + 1)]}}))
    store.append(f"{ns}/1.0/{k}", encode(rank, body, final=final))
    store.add(f"{ns}/1.0/{k}/n", 1)


def test_a_ranks_frames_read_out_of_order_are_taken_in_order(store) -> None:
    # Rank 0 reads exchange 0 before rank 1 has appended to it; rank 1 then appends to
    # 0 and 1 at once (its thread was held up), and rank 0 reads 1: rank 1's frame of 1
    # comes first.  Taken as it came, window 0 would be written without rank 1.
    ns = "phase_timer/order"
    other = store.clone()
    fired = []

    def before(key: str) -> None:
        if key == f"{ns}/1.0/1/n" and not fired:
            fired.append(key)
            send_by_hand(other, ns, 0, 1, 0)
            send_by_hand(other, ns, 1, 1, 1)

    zero = RankExchange(HookedStore(store.clone(), before), 0, 3, ns)
    two = RankExchange(store.clone(), 2, 3, ns)
    written = []
    for w in range(2):
        zero.add(w, 5 * w + 4, 5, sums(forward=1.0))
        two.add(w, 5 * w + 4, 5, sums(forward=2.0))
        two.exchange()
        two._sent_event.wait(5)
        written += zero.exchange()
        zero._sent_event.wait(5)
    assert fired
    send_by_hand(other, ns, 2, 1, None, final=True)
    two.finish(timeout_s=5)
    written += zero.finish(timeout_s=5)
    assert [(w.key, w.ranks) for w in written] == [(0, 3), (1, 3)]
    assert zero.totals.steps == {0: 10, 1: 10, 2: 10}


class GatedStore:
    """A store connection whose appends wait for ``gate``: the rank's thread is held up."""

    def __init__(self, store) -> None:
        self._store, self.gate = store, threading.Event()

    def append(self, *args):
        self.gate.wait(30)
        return self._store.append(*args)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_rank_taken_as_gone_that_was_only_held_up_counts_again_and_leaves_no_keys(store, monkeypatch) -> None:
    monkeypatch.setattr("phase_timer.distributed.rank_reader.STALE_S", 0.0)
    ns = "phase_timer/held"
    before = store.num_keys()
    gated = GatedStore(store.clone())
    exchanges = [RankExchange(store.clone(), 0, 3, ns), RankExchange(store.clone(), 1, 3, ns), RankExchange(gated, 2, 3, ns)]
    written = []
    held_for = STALE_EXCHANGES + 4
    with pytest.warns(RuntimeWarning, match="rank 2 has not reported"):
        for w in range(2 * held_for):
            if w == held_for:
                gated.gate.set()  # rank 2's thread sends its backlog at once, into exchanges already closed
                exchanges[2]._sent_event.wait(10)
            for ex in exchanges:
                ex.add(w, 5 * w + 4, 5, sums(forward=1.0 + ex.rank))
                written += ex.exchange()
            for ex in exchanges[:2]:
                ex._sent_event.wait(5)
    assert 2 in exchanges[0]._gone_said
    for ex in reversed(exchanges):
        written += ex.finish(timeout_s=5)
    assert 2 not in exchanges[0].gone and exchanges[0].finished == {0, 1, 2}
    assert [w.ranks for w in written[-3:]] == [3, 3, 3]  # counted again once it was heard
    exchanges[0]._thread.join(5)
    # Its late appends made closed exchanges' keys again: deleted, and none is deleted before its count is
    # bumped (a bump after the delete would make the key again).
    assert store.num_keys() == before


class SlowCountStore:
    """A store connection whose count bumps wait for ``gate`` (its appends go through): a rank's thread between
    appending its report and counting it."""

    def __init__(self, store) -> None:
        self._store, self.gate, self.appended = store, threading.Event(), threading.Event()

    def append(self, *args):
        out = self._store.append(*args)
        self.appended.set()
        return out

    def add(self, key, n):
        if n:
            self.gate.wait(30)
        return self._store.add(key, n)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_report_read_before_it_is_counted_leaves_no_key(store) -> None:
    # Rank 2 has appended its report to exchange 0 and not yet bumped its count when rank 0 reads it (rank
    # 1's count makes rank 0 read, and the read finds both reports).  Exchange 0 must not be deleted then:
    # rank 2's bump would make its counter key again, after the delete, and nobody would delete that.
    ns = "phase_timer/slowcount"
    before = store.num_keys()
    slow = SlowCountStore(store.clone())
    exchanges = [RankExchange(store.clone(), 0, 3, ns), RankExchange(store.clone(), 1, 3, ns), RankExchange(slow, 2, 3, ns)]
    for ex in exchanges:
        ex.add(0, 4, 5, sums(forward=1.0 + ex.rank))
    exchanges[1].exchange()
    exchanges[1]._sent_event.wait(5)
    exchanges[2].exchange()
    assert slow.appended.wait(5)  # its report is in; its count is held
    exchanges[0].exchange()
    exchanges[0]._sent_event.wait(5)  # rank 0 has read exchange 0: both reports, one counted
    slow.gate.set()
    exchanges[2]._sent_event.wait(5)  # the count is bumped now
    written = []
    for ex in reversed(exchanges):
        written += ex.finish(timeout_s=5)
    exchanges[0]._thread.join(5)
    assert [(w.key, w.ranks) for w in written][:1] == [(0, 3)]
    assert store.num_keys() == before


def test_a_report_never_counted_holds_up_no_exchange_after_it(store, monkeypatch) -> None:
    # Rank 2's report of exchange 0 is appended, and its count fails (the rank's store connection broke):
    # rank 0 reads a report that is never counted.  It must still close that exchange and go on, not read
    # every exchange since at each window (a request more a window, for the rest of the run).
    monkeypatch.setattr("phase_timer.distributed.rank_reader.STALE_S", 0.0)

    class CountFails(SlowCountStore):
        def add(self, key, n):
            if n:
                raise RuntimeError("the store connection broke")
            return self._store.add(key, n)

    ns = "phase_timer/nocount"
    before = store.num_keys()
    broken = CountFails(store.clone())
    exchanges = [RankExchange(store.clone(), 0, 3, ns), RankExchange(store.clone(), 1, 3, ns), RankExchange(broken, 2, 3, ns)]
    windows = STALE_EXCHANGES + 6
    written = []
    with pytest.warns(RuntimeWarning):
        for w in range(windows):
            for ex in exchanges:
                ex.add(w, 5 * w + 4, 5, sums(forward=1.0 + ex.rank))
                written += ex.exchange()
            for ex in exchanges[:2]:
                ex._sent_event.wait(5)
        for ex in reversed(exchanges):
            written += ex.finish(timeout_s=2)
    exchanges[0]._thread.join(5)
    assert exchanges[0]._nodes[0].reader._next >= windows - 1  # every exchange but the last closed in its turn
    assert [w.key for w in written] == list(range(windows))
    assert store.num_keys() == before


def test_a_store_failing_at_the_final_report_warns(store) -> None:
    class FailsSecond:
        def __init__(self) -> None:
            self.calls = 0

        def append(self, *a):
            self.calls += 1
            if self.calls == 2:
                raise ConnectionError("store went away")

        def add(self, *a):
            return 1

    ex = RankExchange(FailsSecond(), 1, 2, "phase_timer/f")
    ex.add(0, 4, 5, sums(forward=1.0))
    ex.exchange()
    with pytest.warns(RuntimeWarning, match="stopped.*store went away"):
        ex.finish(timeout_s=5)
    assert ex.broken


def test_finish_keeps_to_its_timeout(store, monkeypatch) -> None:
    """Rank 1 never reports: rank 0's finish() waits for it until its deadline, on the clock it reads, and no
    longer.  That clock is virtual (every reading 10 ms after the one before), so what is measured is the
    code's waiting, not the machine's speed: a loaded machine takes longer to make the same readings."""
    from types import SimpleNamespace

    import phase_timer.distributed.ranks as ranks_mod

    now = [1000.0]

    def monotonic() -> float:
        now[0] += 0.01
        return now[0]

    monkeypatch.setattr(ranks_mod, "time", SimpleNamespace(monotonic=monotonic, sleep=time.sleep))
    zero = ranks(store, 2, "phase_timer/late")[0]  # rank 1 never reports
    zero.add(0, 4, 5, sums(forward=1.0))
    zero.exchange()
    t0 = monotonic()
    with pytest.warns(RuntimeWarning) as said:
        zero.finish(timeout_s=1)
    waited = monotonic() - t0
    assert 1.0 <= waited < 1.2, waited  # past the deadline by the few readings after it (this one too), no more
    assert [str(w.message) for w in said] == [
        "phase-timer (rank 0): rank(s) [1] sent no final report within 1 s (did the ranks run different numbers of steps?)",
        "phase-timer (rank 0): rank(s) [1] had not finished when rank 0 did: their last windows are missing",
    ]


def test_after_the_exchange_stops_nothing_more_is_kept(store) -> None:
    ex = ranks(store, 2)[1]
    with pytest.warns(RuntimeWarning, match="stopped"):
        ex._give_up("test")
    for key in range(100):
        ex.add(key, key * 5 + 4, 5, sums(forward=1.0))
    assert ex._outbox == [] and ex.exchange() == []


def test_a_store_that_fails_stops_the_exchange_with_a_warning_not_an_error() -> None:
    class Broken:
        def append(self, *a):
            raise ConnectionError("store unreachable")

        add = get = delete_key = append

    ex = RankExchange(Broken(), 1, 2, "phase_timer/x")
    ex.add(0, 4, 5, sums(forward=1.0))
    ex.exchange()
    ex._sent_event.wait(5)
    with pytest.warns(RuntimeWarning, match="stopped.*store unreachable"):
        ex.add(1, 9, 5, sums(forward=1.0))
        assert ex.exchange() == []
    assert ex.broken


def by_hand(store, ns: str, k: int, rank: int, reports: list[list], *, final: bool = False) -> None:
    """Rank ``rank``'s frame of exchange ``k`` to the one group of a small job, with ``reports``."""
    store.append(f"{ns}/1.0/{k}", encode(rank, _json(reports), final=final))
    store.add(f"{ns}/1.0/{k}/n", 1)


def test_a_window_is_written_once_every_rank_reported_it_or_moved_past() -> None:
    from phase_timer.distributed.rank_node import NodeReader
    from phase_timer.distributed.rank_tree import Tree

    store, ns = dist.HashStore(), "phase_timer/rule"
    tree = Tree(3)
    node = NodeReader(tree, tree.root, store, ns)
    by_hand(store, ns, 0, 0, [[0, 4, 5, {"forward": [5.0, 5], "backward": [10.0, 5]}],
                              [1, 9, 5, {"forward": [5.0, 5], "backward": [10.0, 5]}]])
    by_hand(store, ns, 0, 1, [[0, 4, 5, {"forward": [15.0, 5], "backward": [10.0, 5]}]])
    assert node.step(0) == []  # rank 2 has not reported window 0
    by_hand(store, ns, 0, 2, [[1, 9, 5, {"forward": [5.0, 5]}]])  # rank 2 skipped window 0 entirely
    ready = node.step(0)
    assert [w.key for w in ready] == [0]  # window 1 still waits for rank 1
    w = RankWindow.of(ready[0])
    assert w.ranks == 2 and w.step == 4
    assert w.stats("forward") == {"min": 1.0, "median": 2.0, "max": 3.0, "slowest_rank": 1.0}
    by_hand(store, ns, 1, 2, [[0, 4, 5, {"forward": [500.0, 5]}]])  # a late report of a written window is dropped
    by_hand(store, ns, 1, 0, [])
    by_hand(store, ns, 1, 1, [])
    assert node.step(1) == []
    last = node.flush()
    assert [s.key for s in last] == [1] and last[0].ranks == 2


def test_cross_rank_statistics_and_tags() -> None:
    w = RankWindow.from_means(2, 14, {"forward": {0: 1.0, 1: 5.0, 2: 2.0}, "h2d": {0: 0.5, 1: 0.5}})
    assert w.stats("forward") == {"min": 1.0, "median": 2.0, "max": 5.0, "slowest_rank": 1.0}
    assert w.stats("h2d")["slowest_rank"] == 0.0  # a tie names the lowest rank
    scalars = rank_scalars(w)
    assert scalars["phase_time_ranks/forward_ms/max"] == 5.0
    assert scalars["phase_time_ranks/h2d_ms/median"] == 0.5
    assert scalars[RANKS_TAG] == 3.0


def test_rank_table_names_the_slowest_rank_and_missing_ranks() -> None:
    totals = RankTotals(3)
    totals.put(0, {"s": 5, "p": {"forward": [5.0, 5], "step": [15.0, 5]}})
    totals.put(1, {"s": 5, "p": {"forward": [20.0, 5], "step": [30.0, 5]}})
    table = format_rank_table(totals)
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("rank")).split()
    assert head == ["rank", "forward", "step", "steps"]
    rank1 = next(line for line in lines if line.startswith("1 ")).split()
    assert rank1 == ["1", "4.000", "6.000", "5"]
    slowest = next(line for line in lines if line.startswith("slowest")).split()
    assert slowest == ["slowest", "1", "1"]
    assert "per rank (2 of 3)" in table and "no report from rank(s) [2]" in table


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "30", True])
def test_rank_timeout_is_checked_at_construction(bad: object) -> None:
    from phase_timer import PhaseTimer, attach

    with pytest.raises(ValueError, match="rank_timeout_s"):
        PhaseTimer(rank_timeout_s=bad)
    with pytest.raises(ValueError, match="rank_timeout_s"):
        attach(torch.nn.Linear(2, 2), rank_timeout_s=bad, end_step="manual")


def test_not_distributed_means_no_exchange() -> None:
    assert RankExchange.create() is None


@pytest.mark.parametrize("device", [True, False])
def test_each_rank_sends_its_own_data_wait_s_exposed_part_on_a_device_clock(store, device) -> None:
    """Two ranks' cores through the real exchange: rank 1 waits 20 ms a step for its batches; on a (fake) device
    clock its device idles one tick between records, so 1 ms a step of the wait reached it, per window, and rank
    zero holds that from rank 1's own reports (RANK_STRAGGLER reads it); on the host clock nothing more is sent."""
    from phase_timer.phases import EXPOSED_WAIT
    from phase_timer.run.core import TimingCore
    from phase_timer.timing.clock import HostClock
    from tests.fakes import FakeClock

    namespace = f"phase_timer/exposed/{device}"
    cores = [TimingCore(FakeClock(tick_ms=1.0) if device else HostClock(), [], window=5, warmup_steps=0,
                        max_pending=64, ranks=RankExchange(store.clone(), r, 2, namespace))
             for r in range(2)]
    for step in range(20):
        for rank, core in enumerate(cores):
            core.begin_step(step, "h2d")
            core.add_host("data_wait", 20.0 if rank == 1 else 0.01)
            for p in ("forward", "backward", "optimizer"):
                core.phase(p)
            core.close()
    cores[1].finish(5.0)
    cores[0].finish(5.0)
    counts = cores[0].ranks.totals.counts
    if not device:
        assert all(EXPOSED_WAIT not in counts.get(r, {}) for r in range(2))
        return
    # each period 1 ms beyond its 4 ms step (the first step has none: its window's other steps say it): 20 ms
    assert counts[1][EXPOSED_WAIT] == pytest.approx(20.0)
    assert counts[1][EXPOSED_WAIT] == pytest.approx(cores[1].signals.wait_exposed_ms)
    assert counts[0][EXPOSED_WAIT] == pytest.approx(0.2)  # its 0.01 ms waits, all of them
    f = next(x for x in (lambda d: (d, *d.secondary))(cores[0].verdict()) if x.kind == "RANK_STRAGGLER")
    assert (f.evidence["rank"], f.evidence["phase"]) == (1, "data_wait")
    assert f.evidence["device_idle_over_others_ms"] == pytest.approx(1.0 - 0.01)
    assert f.severity != "info" and "reaches the devices" in f.why
