"""The exchange between ranks as a tree of groups: many simulated ranks in this process, over one HashStore.

Each simulated rank has its own RankExchange (and its own exchange thread), as on a real job; the tree is
made small (``FAN_IN`` 4) so that a few hundred ranks make several levels.  What rank zero reads is counted
with a store wrapper: the reports it takes in per exchange, which must not grow with the ranks.  The real
multi-process runs (4 gloo processes, a leader killed) are in test_benchmarks.
"""

from __future__ import annotations

import statistics
import struct
import threading
import warnings

import pytest
import torch.distributed as dist

from phase_timer.distributed import rank_summary

from phase_timer.measures import throughput
from phase_timer.distributed.rank_view import format_rank_table
from phase_timer.distributed.rank_reader import STALE_EXCHANGES
from phase_timer.distributed.rank_summary import EXACT, Spread, Summary
from phase_timer.distributed.rank_tree import Tree
from phase_timer.distributed.ranks import RankExchange, RankWindow

FAN_IN = 4
_HEADER = struct.Struct("<IBI")  # a frame's head: sender, final flag, length (the old design's too)


def frames_in(buf: bytes) -> int:
    n = offset = 0
    while offset + _HEADER.size <= len(buf):
        offset += _HEADER.size + _HEADER.unpack_from(buf, offset)[2]
        n += offset <= len(buf)
    return n


class CountingStore:
    """A rank's store connection that counts the reports it fetched (new frames in each key it read)."""

    def __init__(self, store) -> None:
        self._store, self.frames, self._seen = store, 0, {}

    def get(self, key):
        buf = self._store.get(key)
        n = frames_in(buf)
        self.frames += max(0, n - self._seen.get(key, 0))
        self._seen[key] = max(n, self._seen.get(key, 0))
        return buf

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def report(rank: int, n: int, w: int) -> dict:
    """Rank ``rank``'s window ``w``: 5 steps, rank n-1 the slowest in forward; its memory and counts."""
    forward = 1.0 + 0.5 * rank / n
    return {"values": {"forward": [forward] * 5, "step": [3.0] * 5}, "memory": {"peak_allocated_mb": 1000.0 + rank},
            "counts": {"samples": 40.0, "period_ms": 15.0, "steps": 5.0}}


def job(n: int, store, monkeypatch) -> list[RankExchange]:
    """``n`` ranks in a tree of fan-in 4 (set as a job would have it: no argument the old code lacked)."""
    monkeypatch.setattr("phase_timer.distributed.ranks.FAN_IN", FAN_IN, raising=False)
    return [RankExchange(CountingStore(store), r, n, "phase_timer/tree") for r in range(n)]


def step(exchanges: list[RankExchange], w: int, n: int, *, skip: set[int] = frozenset()) -> list[RankWindow]:
    """Every rank (but ``skip``) writes window ``w`` and exchanges; then their threads catch up, as in a real job's
    seconds between windows."""
    written: list[RankWindow] = []
    for ex in exchanges:
        if ex.rank in skip:
            continue
        r = report(ex.rank, n, w)
        ex.add(w, 5 * w + 4, 5, r["values"], memory=r["memory"], counts=r["counts"])
        written += ex.exchange()
    for ex in exchanges:
        if ex.rank not in skip:
            ex._sent_event.wait(10)
    return written


def finish_all(exchanges: list[RankExchange], timeout_s: float = 10) -> list[RankWindow]:
    """Every rank finishes at once (each on its own thread, as each process would); rank zero's windows."""
    out: dict[int, list[RankWindow]] = {}
    threads = [threading.Thread(target=lambda ex=ex: out.__setitem__(ex.rank, ex.finish(timeout_s))) for ex in exchanges]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out.get(0, [])


def test_rank_zero_reads_a_bounded_number_of_reports_whatever_the_ranks(monkeypatch) -> None:
    # 256 ranks in a tree 4 deep: rank zero takes in the root's 4 summaries an exchange, not 255 reports, and
    # no leader more than its 4 children's; every window still holds every rank, with the right statistics.
    n, windows = 256, 8
    store = dist.HashStore()
    exchanges = job(n, store, monkeypatch)
    written = []
    for w in range(windows):
        written += step(exchanges, w, n)
    written += finish_all(exchanges)
    reads = [ex.store.frames / (windows + 1) for ex in exchanges]
    assert reads[0] <= FAN_IN, reads[0]  # the root's children: rank zero's reads do not grow with the ranks
    assert max(reads) <= FAN_IN + 1, max(reads)  # a leader: its children's (and a final frame read apart)
    exact = statistics.median(1.0 + 0.5 * r / n for r in range(n))
    assert [w.key for w in written] == list(range(windows))
    for w in written:
        assert w.ranks == n and w.step == 5 * w.key + 4
        stats = w.stats("forward")
        assert stats["slowest_rank"] == n - 1 and stats["max"] == pytest.approx(1.0 + 0.5 * (n - 1) / n)
        assert stats["min"] == 1.0 and stats["median"] == pytest.approx(exact, rel=0.005)
        assert (w.peak_mb.lo, w.peak_mb.hi, w.peak_mb.hi_rank) == (1000.0, 1000.0 + n - 1, n - 1)
        assert w.job["samples_per_s"] == pytest.approx(n * 40 / 0.015)
    zero = exchanges[0]
    # The end: every rank finished, and the per-rank table and the job's totals have every rank
    assert zero.finished == set(range(n)) and not zero.gone
    assert sorted(zero.totals.steps) == list(range(n)) and set(zero.totals.steps.values()) == {5 * windows}
    assert zero.totals.mean(n - 1, "forward") == pytest.approx(1.0 + 0.5 * (n - 1) / n)
    assert zero.totals.memory[7] == {"peak_allocated_mb": 1007.0}
    assert zero.totals.counts[3] == {"samples": 40.0 * windows, "period_ms": 15.0 * windows, "steps": 5.0 * windows}
    assert "per rank (256 of 256)" in format_rank_table(zero.totals)
    for ex in exchanges:
        ex._thread.join(5)
    assert store.num_keys() == 0, store.list_keys()  # every group's keys and totals deleted


@pytest.mark.parametrize("dies_after", [2, 0], ids=["after-2-windows", "before-any"])
def test_a_dead_leader_s_group_is_read_by_the_leader_above(monkeypatch, dies_after: int) -> None:
    # 16 ranks, 4 groups of 4; rank 5 leads ranks 4-7 and dies after 2 windows (or before its first).  Rank
    # zero reads that group itself (still not every rank), names rank 5 gone, and writes every window with
    # the 15 others.
    monkeypatch.setattr("phase_timer.distributed.rank_reader.STALE_S", 0.0)  # exchanges are milliseconds apart here
    n, windows = 16, 3 * STALE_EXCHANGES
    store = dist.HashStore()
    exchanges = job(n, store, monkeypatch)
    assert exchanges[0].tree.leader(exchanges[0].tree.node(1, 1)) == 5
    written = []
    with pytest.warns(RuntimeWarning, match="rank 5 has not reported"):
        for w in range(windows):
            written += step(exchanges, w, n, skip={5} if w >= dies_after else set())
        written += finish_all([ex for ex in exchanges if ex.rank != 5])
    zero = exchanges[0]
    assert [w.key for w in written] == list(range(windows))
    assert [w.ranks for w in written[:dies_after]] == [n] * dies_after and all(w.ranks == n - 1 for w in written[-4:])
    assert all(w.stats("forward")["slowest_rank"] == n - 1 for w in written)
    assert zero.gone == {5} and zero.finished == set(range(n)) - {5}
    assert zero.totals.steps[4] == 5 * windows  # its group's table, read on
    assert zero.totals.steps.get(5) == (5 * dies_after or None)
    assert zero.store.frames / (windows + 1) <= 2 * FAN_IN  # the root's children and the adopted group's
    for ex in exchanges:
        if ex.rank != 5:  # rank 5's thread stands for a dead process's: never stopped
            ex._thread.join(5)
    assert store.num_keys() == 0


def test_a_leader_that_finishes_before_its_group_hands_it_over(monkeypatch) -> None:
    # Rank 5 (leading ranks 4-7) runs 3 windows and finishes; the others run 6.  Its wait for its group ends
    # (half the timeout: it is one level of two), and rank zero reads the group on: no window lacks its ranks,
    # and nobody is reported missing.
    n = 16
    store = dist.HashStore()
    exchanges = job(n, store, monkeypatch)
    written = []
    for w in range(3):
        written += step(exchanges, w, n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exchanges[5].finish(timeout_s=1.0)  # its group still runs: it hands the group over after 0.5 s
        for w in range(3, 6):
            written += step(exchanges, w, n, skip={5})
        written += finish_all([ex for ex in exchanges if ex.rank != 5])
    assert not [str(w.message) for w in caught]
    zero = exchanges[0]
    assert [(w.key, w.ranks) for w in written] == [(0, n), (1, n), (2, n), (3, n - 1), (4, n - 1), (5, n - 1)]
    assert zero.finished == set(range(n)) and zero.totals.steps[4] == 30 and zero.totals.steps[5] == 15
    assert zero.store.frames / 7 <= 2 * FAN_IN
    for ex in exchanges:
        ex._thread.join(5)
    assert store.num_keys() == 0


class GatedStore(CountingStore):
    """A rank's connection whose appends wait for ``gate``: its thread is held up, then sends its backlog."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.gate = threading.Event()
        self.gate.set()

    def append(self, *args):
        self.gate.wait(30)
        return self._store.append(*args)


def test_a_leader_held_up_and_taken_as_gone_stops_reading_once_its_group_is_read_above(monkeypatch) -> None:
    # Rank 5's thread is held up long enough for rank zero to read its group itself; released, it sees that
    # and stops: its late reports count again, every window is written once, and no key is left behind.
    monkeypatch.setattr("phase_timer.distributed.rank_reader.STALE_S", 0.0)
    n = 16
    store = dist.HashStore()
    exchanges = job(n, store, monkeypatch)
    gated = exchanges[5].store = GatedStore(store)
    held_for = 2 * STALE_EXCHANGES + 4
    written = []
    with pytest.warns(RuntimeWarning, match="rank 5 has not reported"):
        for w in range(2 * held_for):
            held = 2 <= w < held_for
            if w == 2:
                gated.gate.clear()
            if w == held_for:
                gated.gate.set()  # its backlog goes out at once
                exchanges[5]._sent_event.wait(10)
            written += step(exchanges, w, n, skip={5} if held else set())
            if held:  # its training thread goes on: its exchange thread is what is held up
                exchanges[5].add(w, 5 * w + 4, 5, report(5, n, w)["values"])
                exchanges[5].exchange()
    written += finish_all(exchanges)
    zero = exchanges[0]
    assert zero.store.frames / (2 * held_for + 1) <= 2 * FAN_IN  # the root's children and the adopted group's
    assert exchanges[5]._nodes == []  # it saw that its group is read above it
    keys = [w.key for w in written]
    assert keys == list(range(2 * held_for))  # each window once
    assert [w.ranks for w in written[-3:]] == [n, n, n]  # counted again once it was heard
    assert 5 not in zero.gone and zero.finished == set(range(n))
    for ex in exchanges:
        ex._thread.join(5)
    assert store.num_keys() == 0


# -- the pieces: the tree, and a window across ranks that merges ----------------------------------------
@pytest.mark.parametrize("n,fan_in", [(2, 64), (64, 64), (65, 64), (4097, 64), (16384, 64), (300, 4), (1000, 3)])
def test_the_tree_covers_every_rank_once_and_rank_zero_reads_only_the_root(n: int, fan_in: int) -> None:
    tree = Tree(n, fan_in)
    assert fan_in ** (tree.depth - 1) < n <= fan_in**tree.depth
    assert tree.led_by(0) == [tree.root]
    led = [node for r in range(n) for node in tree.led_by(r)]
    for level in range(1, tree.depth + 1):
        nodes = [x for x in led if x.level == level]
        assert sorted(r for x in nodes for r in range(x.start, x.end)) == list(range(n))  # each rank once a level
        for x in nodes:
            assert x.start <= tree.leader(x) < x.end and 1 <= len(tree.children(x)) <= fan_in
            parent = tree.parent(x)
            assert parent is None or x.index in tree.children(parent)
    assert all(tree.leaf_node(r).start <= r < tree.leaf_node(r).end for r in range(n))
    if tree.depth < fan_in:  # no rank leads two groups, but in a tail group of fewer ranks than its level
        assert all(sum(x.end - x.start > x.level for x in tree.led_by(r)) <= 1 for r in range(n))


def test_a_spread_is_exact_up_to_64_ranks_and_within_half_a_percent_beyond() -> None:
    values = [10.0 + (r * 37 % 101) / 10 for r in range(300)]  # 10.0-20.0 ms, unordered
    small = Spread()
    for r, v in enumerate(values[:EXACT]):
        small.add(v, r)
    assert small.buckets is None and small.median() == statistics.median(values[:EXACT])
    # 300 ranks merged in any grouping, as summaries come up the tree: the same spread
    groups = [values[i : i + 7] for i in range(0, 300, 7)]
    spreads = []
    for g, group in enumerate(groups):
        s = Spread()
        for i, v in enumerate(group):
            s.add(v, 7 * g + i)
        spreads.append(Spread.from_wire(s.wire()))
    merged = Spread()
    for s in reversed(spreads):
        merged.merge_wire(s.wire())
    assert merged.n == 300 and merged.lo == min(values) and merged.hi == max(values)
    assert merged.hi_rank == values.index(max(values))  # the lowest rank of those tied at the top
    assert merged.median() == pytest.approx(statistics.median(values), rel=0.005)


def test_a_summary_carries_a_window_across_ranks_and_merges() -> None:
    a, b = Summary(3), Summary(3)
    a.add_report(0, [3, 19, 5, {"forward": [10.0, 5]}, {"peak_allocated_mb": 100.0,
                                                        "counts": {"samples": 8.0, "period_ms": 4.0, "steps": 5.0}}])
    b.add_report(1, [3, 19, 5, {"forward": [20.0, 5], "h2d": [1.0, 5]}, {"peak_allocated_mb": 300.0}])
    b.add_report(2, [3, 18, 5, {"forward": [20.0, 5]}])
    a.merge_wire(b.wire())
    w = RankWindow.of(a)
    assert (w.key, w.step, w.ranks) == (3, 19, 3)
    assert w.stats("forward") == {"min": 2.0, "median": 4.0, "max": 4.0, "slowest_rank": 1.0}  # a tie: rank 1
    assert w.phases["h2d"].n == 1
    assert (w.peak_mb.median(), w.peak_mb.hi_rank) == (200.0, 1)
    assert w.job == {"samples_per_s": 2000.0}  # steps/s is a rank's, not the job's sum
    assert rank_summary.COUNTS == throughput.COUNTS  # named twice (an import cycle otherwise): the same
