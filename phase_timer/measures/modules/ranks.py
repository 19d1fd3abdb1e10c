"""Which module on every rank: each rank's rows ride its window reports to rank zero, which names the module
where the slow rank loses its time (the table's modules line, the summary's ``modules.ranks``).

A rank reports, per row read since its last report, its summed ``forward_ms`` and ``backward_ms`` and how many
samples each sums (:func:`report_key`); rank zero's exchange sums them per rank (``RankTotals.counts``).  Every rank
samples the same steps (``times.ModuleTimes._schedule``), so each rank's means are of the same steps.
"""

from __future__ import annotations

import statistics
from typing import Any

#: A rank's reported row sums: ``<PREFIX><row>|<forward_ms or backward_ms>``, and the count of samples behind each
#: with ``#`` after it.
PREFIX = "modules|"
#: A rank's phase this far above the other ranks' median, in ms and as a share of it, is the slow rank's: its
#: modules are compared then (below, the phase's spread is the ranks' noise).
SLOW_MS, SLOW_SHARE = 0.5, 0.05
#: A module is named only where it holds this share of the slow rank's gap in the phase, and SLOW_MS: a gap that
#: lies outside the modules (a rank that waits for its peers in a collective) names none.
MODULE_SHARE = 0.25
PHASES = ("forward", "backward")


def report_key(row: str, name: str) -> str:
    return f"{PREFIX}{row}|{name}"


def per_rank(counts: dict[int, dict[str, float]]) -> dict[int, dict[str, dict[str, float]]]:
    """rank -> row -> {``forward_ms``, ``backward_ms``}: each rank's means over its samples."""
    out: dict[int, dict[str, dict[str, float]]] = {}
    for rank, sums in counts.items():
        for key, total in sums.items():
            if not key.startswith(PREFIX) or key.endswith("#"):
                continue
            n = sums.get(key + "#")
            if not n:
                continue
            row, name = key[len(PREFIX):].rsplit("|", 1)
            out.setdefault(rank, {}).setdefault(row, {})[name] = total / n
    return out


def slow_modules(totals: Any, rows: set[str] | None = None) -> list[dict[str, Any]]:
    """Per phase (forward, backward): the rank furthest above the other ranks' median in it (``totals.mean``), where
    that is material (SLOW_MS and SLOW_SHARE), and of ``rows`` (None: every row; the table gives the leaves, whose
    times are not counted twice) the one whose time on that rank is furthest above the other ranks' median of it:
    where the slow rank loses its time.  Nothing for a phase where no rank is material, nor where no row holds
    MODULE_SHARE of the gap and SLOW_MS (the gap is outside the modules)."""
    means = per_rank(getattr(totals, "counts", None) or {})
    out: list[dict[str, Any]] = []
    ranks = sorted(getattr(totals, "steps", {}) or {})
    for phase in PHASES:
        by_rank = {r: m for r in ranks if (m := totals.mean(r, phase)) is not None}
        if len(by_rank) < 2:
            continue
        slow = max(by_rank, key=lambda r: (by_rank[r], -r))
        others = statistics.median(v for r, v in by_rank.items() if r != slow)
        gap = by_rank[slow] - others
        if gap < SLOW_MS or gap < SLOW_SHARE * others:
            continue
        name = f"{phase}_ms"
        best: tuple[float, str, float, float] | None = None
        for row, vals in (means.get(slow) or {}).items():
            if name not in vals or (rows is not None and row not in rows):
                continue
            theirs = [means[r][row][name] for r in by_rank if r != slow and name in (means.get(r, {}).get(row) or {})]
            if not theirs:
                continue
            med = statistics.median(theirs)
            excess = vals[name] - med
            if excess > 0 and (best is None or excess > best[0]):
                best = (excess, row, vals[name], med)
        if best is not None and best[0] >= max(SLOW_MS, MODULE_SHARE * gap):
            out.append({"rank": slow, "phase": phase, "rank_ms": by_rank[slow], "others_ms": others,
                        "module": best[1], "module_ms": best[2], "module_others_ms": best[3],
                        "module_gap_ms": best[0]})
    return out


def text(found: list[dict[str, Any]]) -> str | None:
    """The table's words for :func:`slow_modules` (None: nothing named)."""
    if not found:
        return None
    parts = [f"rank {f['rank']}'s {f['phase']} {f['rank_ms'] - f['others_ms']:.2f} ms a step above the other ranks' "
             f"median ({f['others_ms']:.2f}), {f['module_gap_ms']:.2f} of it in {f['module']} ({f['module_ms']:.2f} ms "
             f"against {f['module_others_ms']:.2f})" for f in found]
    return "every rank: " + "; ".join(parts)


def block(totals: Any, rows: set[str] | None = None) -> dict[str, Any]:
    """The summary's ``modules.ranks``: each rank's rows' means, and the slow rank's module per phase (of ``rows``)."""
    return {"per_rank": {str(r): means for r, means in sorted(per_rank(totals.counts or {}).items())},
            "slow": slow_modules(totals, rows)}
