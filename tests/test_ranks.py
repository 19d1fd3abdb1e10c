"""The cross-rank bookkeeping on its own (the real 2-process runs are in test_distributed)."""

from __future__ import annotations

import json

import pytest
import torch

from phase_timer.metrics import RANKS_TAG, format_rank_table, rank_scalars
from phase_timer.ranks import CAPACITY, RankExchange, RankWindow, decode, encode


def sums(**ms: float) -> dict[str, list[float]]:
    """A window of 5 steps whose every value of a phase is ``ms[phase]``."""
    return {p: [v] * 5 for p, v in ms.items()}


def test_report_round_trips_through_a_byte_tensor() -> None:
    windows = [[3, 19, 5, {"forward": [10.5, 5], "step": [50.25, 5]}], [4, 24, 5, {"forward": [1.0, 5]}]]
    buf = encode([json.dumps(w).encode() for w in windows], final=True)
    assert buf.dtype == torch.uint8 and buf.numel() == CAPACITY
    assert decode(buf) == {"final": True, "windows": windows}
    assert decode(encode([])) == {"final": False, "windows": []}


def test_after_the_exchange_stops_nothing_more_is_kept() -> None:
    ex = RankExchange(group=None, rank=1, world_size=2)
    with pytest.warns(RuntimeWarning, match="stopped"):
        ex._give_up("test")
    for key in range(100):
        ex.add(key, key * 5 + 4, 5, sums(forward=1.0))
    assert ex._outbox == [] and ex.exchange() == []


def test_a_window_is_written_once_every_rank_reported_it_or_moved_past() -> None:
    ex = RankExchange(group=None, rank=0, world_size=3)
    ex.add(0, 4, 5, sums(forward=1.0, backward=2.0))  # rank zero keeps its own
    ex.add(1, 9, 5, sums(forward=1.0, backward=2.0))
    ex._receive(1, [0, 4, 5, {"forward": [15.0, 5], "backward": [10.0, 5]}])
    assert ex._ready(final=False) == []  # rank 2 has not reported window 0
    ex._receive(2, [1, 9, 5, {"forward": [5.0, 5]}])  # rank 2 skipped window 0 entirely
    ready = ex._ready(final=False)
    assert [w.key for w in ready] == [0]  # window 1 still waits for rank 1
    w = ready[0]
    assert w.ranks == 2 and w.step == 4
    assert w.means["forward"] == {0: 1.0, 1: 3.0}
    # a late report of a written window is dropped, not double counted
    ex._receive(2, [0, 4, 5, {"forward": [500.0, 5]}])
    last = ex._ready(final=True)
    assert [w.key for w in last] == [1] and last[0].ranks == 2
    assert ex.totals is not None
    assert ex.totals.mean(1, "forward") == pytest.approx(3.0)
    assert ex.totals.mean(2, "forward") == pytest.approx(1.0)
    assert ex.totals.steps == {0: 10, 1: 5, 2: 5}


def test_other_ranks_send_their_windows_and_write_nothing() -> None:
    ex = RankExchange(group=None, rank=1, world_size=2)
    ex.add(0, 4, 5, sums(forward=1.0))
    assert ex._outbox and ex.totals is None
    assert ex._ready(final=True) == []


def test_cross_rank_statistics_and_tags() -> None:
    w = RankWindow(key=2, step=14, means={"forward": {0: 1.0, 1: 5.0, 2: 2.0}, "h2d": {0: 0.5, 1: 0.5}}, ranks=3)
    assert w.stats("forward") == {"min": 1.0, "median": 2.0, "max": 5.0, "slowest_rank": 1.0}
    assert w.stats("h2d")["slowest_rank"] == 0.0  # a tie names the lowest rank
    scalars = rank_scalars(w)
    assert scalars["phase_time_ranks/forward_ms/max"] == 5.0
    assert scalars["phase_time_ranks/h2d_ms/median"] == 0.5
    assert scalars[RANKS_TAG] == 3.0


def test_rank_table_names_the_slowest_rank_and_missing_ranks() -> None:
    ex = RankExchange(group=None, rank=0, world_size=3)
    ex.add(0, 4, 5, sums(forward=1.0, step=3.0))
    ex._receive(1, [0, 4, 5, {"forward": [20.0, 5], "step": [30.0, 5]}])
    ex._ready(final=True)
    assert ex.totals is not None
    table = format_rank_table(ex.totals)
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
