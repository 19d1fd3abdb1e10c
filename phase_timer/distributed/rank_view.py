"""Every rank in the outputs read back: the per-rank table of ``report``, and ``compare``'s slowest ranks.

Under torch.distributed, rank zero's summary file holds each rank's mean a phase over the run (its ``ranks``
block).  The table phase-timer prints at the end (:func:`format_rank_table`) is made from the same means
(:func:`format_rank_means`), so ``phase-timer report`` prints it from the file.

``compare`` reads the phases of rank zero (the run's own statistics, with their window-to-window noise); a
regression on another rank can hide there: rank 1 slowed in forward leaves rank 0's forward as it was, and shows
on rank 0 only as a longer wait.  So ``compare`` also takes, for each phase, the slowest rank's mean on each side
(:func:`compare_ranks`), and says which rank moved where rank zero's view did not (:func:`rank_verdicts`): its
delta against rank zero's.  The per-rank means carry no window-to-window noise; the verdict needs a change of
at least RANK_MATERIAL_PCT and RANK_MATERIAL_MS beyond rank zero's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phase_timer.phases import RANK_WAITS, TOTALS, ordered

#: A slowest rank's change that rank zero's view does not show: at least this many percentage points and ms more.
RANK_MATERIAL_PCT = 10.0
RANK_MATERIAL_MS = 0.1
#: Phases the ranks that wait for a slow one show it in: they move with any straggler, no verdict of their own.
_WAITS = RANK_WAITS | set(TOTALS)

NOTE = ("mean ms per step.  A slow rank is slowest in the phase where it loses time; the ranks\n"
        "that wait for it show the wait in backward (the gradient all-reduce) and, under\n"
        "Lightning, in sync_wait (its per-batch broadcast).")


def format_rank_means(means: dict[int, dict[str, float | None]], steps: dict[int, int], world_size: int,
                      title: str = "phase-timer") -> str:
    """Per rank, each phase's mean ms, and the rank with the largest mean."""
    ranks = sorted(steps)
    phases = ordered({p for r in ranks for p in means.get(r, {})})
    if not ranks or not phases:
        return f"{title}: no window was reported by the ranks"
    head = ["rank", *phases, "steps"]
    rows = []
    for r in ranks:
        row = [means.get(r, {}).get(p) for p in phases]
        rows.append([str(r), *("" if m is None else f"{m:.3f}" for m in row), str(steps[r])])
    slowest = ["slowest"]
    for p in phases:
        by_rank = {r: m for r in ranks if (m := means.get(r, {}).get(p)) is not None}
        slowest.append(str(max(by_rank, key=lambda r: (by_rank[r], -r))) if by_rank else "")
    rows.append([*slowest, ""])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    rule = "-" * len(line(head))
    missing = sorted(set(range(world_size)) - set(ranks))
    note = NOTE + (f"\nno report from rank(s) {missing}" if missing else "")
    body = "\n".join(line(r) for r in rows[:-1])
    return f"{title}: per rank ({len(ranks)} of {world_size})\n{rule}\n{line(head)}\n{rule}\n{body}\n{rule}\n{line(rows[-1])}\n{rule}\n{note}"


def format_rank_table(totals: Any, title: str = "phase-timer") -> str:
    """The run's per-rank table (``ranks.RankTotals``): each rank's mean ms a phase over the run."""
    means = {r: {p: totals.mean(r, p) for p in totals.sums.get(r, {})} for r in totals.steps}
    return format_rank_means(means, dict(totals.steps), totals.world_size, title)


def from_summary(block: dict[str, Any] | None) -> tuple[dict[int, dict[str, float | None]], dict[int, int], int] | None:
    """(means, steps, world size) of a summary file's ``ranks`` block, or None (one process)."""
    if not block or not block.get("per_rank"):
        return None
    per = block["per_rank"]
    means = {int(r): dict(v.get("mean_ms") or {}) for r, v in per.items()}
    steps = {int(r): int(v.get("steps") or 0) for r, v in per.items()}
    return means, steps, int(block.get("world_size") or len(per))


def summary_table(block: dict[str, Any] | None, title: str = "phase-timer") -> str | None:
    """``report``'s per-rank table from a summary file's ``ranks`` block (None: one process)."""
    got = from_summary(block)
    return format_rank_means(*got, title=title) if got is not None else None


@dataclass(frozen=True)
class RankRow:
    """One phase: the slowest rank's mean on each side (and which rank), and rank zero's."""

    phase: str
    base_ms: float
    base_rank: int
    cand_ms: float
    cand_rank: int
    base0_ms: float | None
    cand0_ms: float | None

    @property
    def delta_pct(self) -> float | None:
        return 100 * (self.cand_ms - self.base_ms) / self.base_ms if self.base_ms > 0 else None

    @property
    def zero_pct(self) -> float | None:
        if self.base0_ms is None or self.cand0_ms is None or self.base0_ms <= 0:
            return None
        return 100 * (self.cand0_ms - self.base0_ms) / self.base0_ms


def _slowest(means: dict[int, dict[str, float | None]], phase: str) -> tuple[float, int] | None:
    by_rank = {r: m for r, ms in means.items() if (m := ms.get(phase)) is not None}
    if not by_rank:
        return None
    r = max(by_rank, key=lambda k: (by_rank[k], -k))
    return by_rank[r], r


def compare_ranks(base: dict[str, Any] | None, cand: dict[str, Any] | None) -> list[RankRow] | None:
    """Each phase both sides' ranks report: the slowest rank's mean on each side, and rank zero's (None: a side
    ran in one process)."""
    b, c = from_summary(base), from_summary(cand)
    if b is None or c is None:
        return None
    rows = []
    for phase in ordered({p for ms in b[0].values() for p in ms} & {p for ms in c[0].values() for p in ms}):
        sb, sc = _slowest(b[0], phase), _slowest(c[0], phase)
        if sb is None or sc is None:
            continue
        rows.append(RankRow(phase, sb[0], sb[1], sc[0], sc[1], b[0].get(0, {}).get(phase), c[0].get(0, {}).get(phase)))
    return rows


def rank_verdicts(rows: list[RankRow] | None) -> list[str]:
    """The phases where the slowest rank moved beyond rank zero's own change: which rank, from what to what."""
    out = []
    for r in rows or ():
        if r.phase in _WAITS or r.delta_pct is None:
            continue
        zero = r.zero_pct if r.zero_pct is not None else 0.0
        zero_ms = (r.cand0_ms or 0.0) - (r.base0_ms or 0.0)
        if (abs(r.delta_pct - zero) >= RANK_MATERIAL_PCT
                and abs((r.cand_ms - r.base_ms) - zero_ms) >= RANK_MATERIAL_MS):
            way = "slower" if r.cand_ms > r.base_ms else "faster"
            out.append(f"{r.phase}: rank {r.cand_rank} {way}, the slowest rank's {r.base_ms:.3f} ms (rank "
                       f"{r.base_rank}) -> {r.cand_ms:.3f} ms ({r.delta_pct:+.1f}%), where rank 0's own moved "
                       f"{zero:+.1f}%: a regression rank 0's figures do not show (the per-rank means carry no noise "
                       "band)")
    return out


def format_rank_comparison(rows: list[RankRow]) -> str:
    from tabulate import tabulate

    table = [(r.phase, f"{r.base_ms:.3f} (rank {r.base_rank})", f"{r.cand_ms:.3f} (rank {r.cand_rank})",
              f"{r.cand_ms - r.base_ms:+.3f}", "" if r.delta_pct is None else f"{r.delta_pct:+.1f}",
              "" if r.zero_pct is None else f"{r.zero_pct:+.1f}") for r in rows]
    heads = ("phase", "baseline slowest rank ms", "candidate slowest rank ms", "delta ms", "delta %",
             "rank 0's delta %")
    return "every rank: each phase's slowest rank (mean ms per step)\n" + tabulate(
        table, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 5)
