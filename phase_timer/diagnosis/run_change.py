"""RUN_CHANGED: a phase whose level moved, for good, partway through the run.

``UNSTABLE`` reads each window on its own; a run whose step went from 130 ms to 3 ms after its fourth window,
or whose forward took 20 ms more from step 100 on, is steady inside every window.  This rule reads the windows
in order.  Each phase's series is its windows' medians (``stats.WindowSeries``: one point a window, pairs
merged past 256, so a long run keeps the shape of its history in bounded memory), and on rank zero of a
distributed run also the slowest rank's value each window (``RankShifts``, with which rank it was).

A change is a split of a series into a *before* and an *after* of at least MIN_SIDE points each whose
medians differ by at least SHIFT_SHARE of the smaller one, SHIFT_OF_PERIOD of the run's median ``period``
and MIN_SHIFT_MS, by at least SPREAD_TIMES the points' own spread about their side's median (pooled, the
median absolute deviation), with at least SEPARATED of each side's points on its side of the two medians'
midpoint: a level that moved and stayed, not a trend, not one spike.  Of the splits that qualify, the one the
two levels fit best (the least absolute deviation from each side's median) says where.  The finding names the
phase whose level moved most, the step from which it moved (the first step of the first window after the
split), before and after, and the other phases that moved at the same place; under torch.distributed, the
rank whose value moved where only one rank's did.  A phase a rank spends its own time in leads before one in
which ranks wait for each other (``backward``, ``sync_wait``, the ``comm_wait`` rows): a rank turned slow in
forward makes the others' backward longer by as much.

The rule costs nothing while training: it runs once, on the series, when the diagnosis is made.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from phase_timer.phases import RANK_WAITS, TOTALS

#: At least this many points (windows, or merged batches of them) on each side of a change.
MIN_SIDE = 2
#: The shift is at least this share of the smaller side's level, ...
SHIFT_SHARE = 0.10
#: ... this share of the run's median ``period`` (or ``step``), ...
SHIFT_OF_PERIOD = 0.02
#: ... and this many ms; ...
MIN_SHIFT_MS = 0.05
#: ... it stands this many times above the points' own spread (pooled MAD, scaled to a standard deviation) ...
SPREAD_TIMES = 4.0
#: ... and this share of each side's points lies on its own side of the midpoint.
SEPARATED = 0.9
#: A change of at least this share of ``period`` is a medium finding; a smaller one is info.
MATERIAL = 0.10



@dataclass(frozen=True)
class Shift:
    """A level that moved: from ``before`` to ``after`` (ms, the sides' medians) at ``at_step``."""

    phase: str
    at_step: int
    before: float
    after: float
    score: float
    rank: int | None = None

    @property
    def delta(self) -> float:
        return self.after - self.before


def find_shift(points: list[tuple[int, float]], floor_ms: float) -> tuple[int, float, float, float] | None:
    """``(split index, before, after, score)`` of the clearest level change in ``points`` (``(last step, value)``
    in step order), or None; ``floor_ms``: the smallest shift that counts."""
    values = [v for _, v in points]
    n = len(values)
    best = None
    for k in range(MIN_SIDE, n - MIN_SIDE + 1):
        left, right = values[:k], values[k:]
        before, after = statistics.median(left), statistics.median(right)
        shift = abs(after - before)
        if shift < max(floor_ms, SHIFT_SHARE * min(abs(before), abs(after)), MIN_SHIFT_MS):
            continue
        spread = 1.4826 * statistics.median([abs(v - before) for v in left] + [abs(v - after) for v in right])
        if shift < SPREAD_TIMES * spread:
            continue
        mid = (before + after) / 2
        up = after > before
        low_side = sum((v < mid) == up for v in left) / len(left)
        high_side = sum((v > mid) == up for v in right) / len(right)
        if low_side < SEPARATED or high_side < SEPARATED:
            continue
        cost = sum(abs(v - before) for v in left) + sum(abs(v - after) for v in right)
        if best is None or cost < best[4]:  # where: the split the two levels fit best (least absolute deviation)
            best = (k, before, after, shift / (spread + 1e-3 * shift), cost)
    return best[:4] if best is not None else None


def series_points(series: Any, phase: str) -> list[tuple[int, float]]:
    """A phase's points in a ``WindowSeries``: (the batch's last step, its count-weighted median)."""
    out = []
    for _, last, phases in series.batches:
        acc = phases.get(phase)
        if acc is not None and acc[0] > 0:
            out.append((last, acc[2] / acc[0]))
    return out


class RankShifts:
    """Rank zero's record of each window across ranks: per phase, the slowest rank's value and which rank it
    was (bounded: past ``max_points`` windows, adjacent pairs merge; the later rank stays)."""

    def __init__(self, max_points: int = 512) -> None:
        self.max_points = max_points
        self.points: dict[str, list[tuple[int, float, int]]] = {}

    def add(self, step: int, spreads: dict[str, Any]) -> None:
        for phase, spread in spreads.items():
            if spread.n < 2:
                continue
            pts = self.points.setdefault(phase, [])
            pts.append((step, spread.hi, spread.hi_rank))
            if len(pts) >= self.max_points:
                self.points[phase] = [(b[0], (a[1] + b[1]) / 2, b[2]) for a, b in zip(pts[::2], pts[1::2])]


def _first_step(points: list[tuple[int, float]], k: int) -> int:
    """The first step after the split: one past the last step before it."""
    return points[k - 1][0] + 1


def detect(series: Any, scale_ms: float | None, ranks: RankShifts | None = None) -> list[Shift]:
    """Every phase's change (largest first), this process's windows and, on rank zero, the slowest rank's."""
    floor = SHIFT_OF_PERIOD * scale_ms if scale_ms else 0.0
    found: list[Shift] = []
    phases = {p for _, _, ph in series.batches for p in ph}
    for phase in sorted(phases):
        pts = series_points(series, phase)
        hit = find_shift(pts, floor)
        if hit is not None:
            k, before, after, score = hit
            found.append(Shift(phase, _first_step(pts, k), before, after, score))
    if ranks is not None:
        for phase, triples in ranks.points.items():
            pts = [(s, v) for s, v, _ in triples]
            hit = find_shift(pts, floor)
            if hit is None:
                continue
            k, before, after, score = hit
            side = triples[k:] if after > before else triples[:k]
            named = [r for _, _, r in side]
            rank = max(set(named), key=named.count)
            if named.count(rank) >= SEPARATED * len(named):
                found.append(Shift(phase, _first_step(pts, k), before, after, score, rank))
    found.sort(key=lambda s: -abs(s.delta))
    return found


def finding(series: Any, scale_ms: float | None, ranks: RankShifts | None = None) -> tuple | None:
    """The RUN_CHANGED finding's ``(severity, why, next, evidence)`` (``diagnosis`` makes it one), or None."""
    shifts = detect(series, scale_ms, ranks)
    if not shifts:
        return None
    # the phase that moved most, one a rank spends its own time in before one the others wait in (a straggler's
    # forward before the others' backward, which holds their wait for it), before the totals
    own = [s for s in shifts if s.phase not in TOTALS and s.phase not in RANK_WAITS]
    waits = [s for s in shifts if s.phase not in TOTALS and s.phase in RANK_WAITS]
    lead = (own or waits or shifts)[0]
    # the same phase from the ranks' series (its slowest rank) and this rank's: the rank's when only one moved
    lead = next((s for s in shifts if s.phase == lead.phase and s.rank is not None), lead)
    who = f"rank {lead.rank}'s " if lead.rank is not None else ""
    ratio = lead.after / lead.before if lead.before > 0 else None
    pct = (f"{ratio:.3g}x" if ratio is not None and (ratio >= 10 or ratio <= 0.1) else
           f"{100 * (ratio - 1):+.0f}%" if ratio is not None else "from nothing")
    why = (f"{who}{lead.phase} went from {lead.before:.3g} ms to {lead.after:.3g} ms a step from step "
           f"~{lead.at_step} on ({lead.delta:+.3g} ms, {pct}), and stayed there")
    near = [s for s in shifts if s is not lead and s.phase != lead.phase and abs(s.at_step - lead.at_step)
            <= max(1, lead.at_step // 10) and s.rank is None]
    if near:
        why += "; at the same place " + ", ".join(f"{s.phase} {s.before:.3g} -> {s.after:.3g} ms" for s in near[:3])
    share = abs(lead.delta) / scale_ms if scale_ms else 0.0
    tips = [f"look at what changed around step {lead.at_step}: the per-step values (per_step=True) and the windows' "
            "series in TensorBoard show its shape",
            "a slower loader after an epoch, a checkpoint or an evaluation that left a cost behind, a learning-rate or "
            "batch-size schedule, throttling (the device's clocks and temperature), another job on the machine"]
    if lead.rank is not None:
        tips.insert(1, f"rank {lead.rank} alone: its host and device (nvidia-smi on its node), its data shard")
    evidence = {"phase": lead.phase, "at_step": lead.at_step, "before_ms": lead.before, "after_ms": lead.after,
                "rank": lead.rank, "share_of_period": share,
                "changes": [{"phase": s.phase, "at_step": s.at_step, "before_ms": s.before, "after_ms": s.after,
                             "rank": s.rank} for s in shifts[:8]]}
    return "medium" if share >= MATERIAL else "info", why, tuple(tips), evidence
