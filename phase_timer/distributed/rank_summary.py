"""One window across many ranks, in a form that merges: what a leader sends up instead of its ranks' reports.

A :class:`Spread` is one phase's per-rank means across some ranks: how many, the smallest, the largest
and which rank had it (a tie names the lowest rank), and the values themselves while there are at most
``EXACT`` of them, else their log histogram (buckets 1% wide, as the run's percentiles in ``stats.py``).
So the median across ranks is exact up to 64 ranks, within 0.5% beyond, and a spread over 16k ranks is
as small as one over 64: a leader's summary does not grow with the ranks under it.

A :class:`Summary` is one window across some ranks: each phase's spread, the peak memory's, the job's
samples and tokens a second (each rank's rate, summed), the newest step, and how many ranks are in it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from phase_timer.timing.stats import _GROWTH, _ZERO, bucket_counts

#: Values kept one by one up to this many ranks (an exact median); a histogram beyond.
EXACT = 64
#: ``throughput.COUNTS``, named here: that module imports the config, which (through trace, metrics and
#: ranks) imports this one.
COUNTS = ("samples", "tokens")
#: A spread of more ranks than this goes up the tree as its histogram (~10 buckets for ranks
#: within 10% of each other, against 8 bytes and more a rank).
WIRE_EXACT = 8


class Spread:
    """One phase's per-rank values across ranks (see the module's text)."""

    __slots__ = ("n", "lo", "hi", "hi_rank", "values", "buckets")

    def __init__(self) -> None:
        self.n = 0
        self.lo = math.inf
        self.hi = -math.inf
        self.hi_rank = -1
        self.values: list[float] = []
        self.buckets: dict[int, int] | None = None

    def add(self, value: float, rank: int) -> None:
        self.n += 1
        self._bounds(value, value, rank)
        if self.buckets is None:
            self.values.append(value)
            if self.n > EXACT:
                self._to_buckets()
        else:
            self._count([value])

    def merge(self, other: Spread) -> None:
        self.merge_wire(other.wire(exact=True))

    def merge_wire(self, w: list[Any]) -> None:
        """Merge another spread in its wire form (as it came up the tree: no object made for it)."""
        self.n += w[0]
        self._bounds(w[1], w[2], w[3])
        values = w[4]
        if values is not None and self.buckets is None and self.n <= EXACT:
            self.values.extend(values)
            return
        self._to_buckets()
        if values is not None:
            self._count(values)
            return
        mine = self.buckets
        assert mine is not None
        flat = w[5]
        for i in range(0, len(flat), 2):
            mine[flat[i]] = mine.get(flat[i], 0) + flat[i + 1]

    def _bounds(self, lo: float, hi: float, hi_rank: int) -> None:
        if lo < self.lo:
            self.lo = lo
        if hi > self.hi or (hi == self.hi and hi_rank < self.hi_rank):
            self.hi, self.hi_rank = hi, hi_rank

    def _count(self, values: list[float]) -> None:
        bucket_counts(sorted(values), self.buckets)

    def _to_buckets(self) -> None:
        if self.buckets is None:
            self.buckets = bucket_counts(sorted(self.values))
            self.values = []

    def median(self) -> float:
        if self.buckets is None:
            return statistics.median(self.values)
        # The two middle values (one when n is odd), each the geometric middle of its bucket, as
        # PhaseTotals.quantile: their mean, as statistics.median takes.
        low, high = (self.n - 1) // 2, self.n // 2
        found: list[float] = []
        seen = 0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            while len(found) < 2 and seen > (low, high)[len(found)]:
                found.append(max(0.0, self.lo) if key == _ZERO else min(max(_GROWTH ** (key + 0.5), self.lo), self.hi))
            if len(found) == 2:
                break
        return (found[0] + found[1]) / 2 if len(found) == 2 else self.hi

    def median_of_rest(self) -> float:
        """The median without the largest rank's value: what a slow rank is measured against (with two ranks, the
        other one; the median of all would be half-way to the slow one).  Past the exact values (many ranks), the
        median of all, which one rank barely moves."""
        if self.n == 2:
            return self.lo
        if self.buckets is None and len(self.values) == self.n and self.n > 2:
            rest = sorted(self.values)[:-1]
            return statistics.median(rest)
        return self.median()

    def stats(self) -> dict[str, float]:
        return {"min": self.lo, "median": self.median(), "max": self.hi, "slowest_rank": float(self.hi_rank)}

    def wire(self, *, exact: bool = False) -> list[Any]:
        """``[n, lo, hi, hi_rank, values]``, or ``[n, lo, hi, hi_rank, None, [bucket, count, ...]]`` beyond
        ``WIRE_EXACT`` values (``exact``: the values while they are kept)."""
        head: list[Any] = [self.n, self.lo, self.hi, self.hi_rank]
        if self.buckets is None and (exact or self.n <= WIRE_EXACT):
            return [*head, self.values]
        buckets = self.buckets if self.buckets is not None else bucket_counts(sorted(self.values))
        return [*head, None, [x for item in buckets.items() for x in item]]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Spread:
        s = cls()
        s.merge_wire(w)
        return s


class Summary:
    """One window across some ranks (see the module's text)."""

    __slots__ = ("key", "step", "ranks", "phases", "peak", "job")

    def __init__(self, key: int) -> None:
        self.key = key
        self.step = -1
        self.ranks = 0
        self.phases: dict[str, Spread] = {}
        #: Peak allocated MB across the ranks that read memory (CUDA ranks).
        self.peak: Spread | None = None
        #: The job's rates over these ranks: each rank's (its counts over its own period), summed.
        self.job: dict[str, float] = {}

    def add_report(self, rank: int, report: list[Any]) -> None:
        """One rank's window report: ``[key, last_step, steps, {phase: [sum_ms, count]}, extra?]``."""
        self.ranks += 1
        if report[1] > self.step:
            self.step = report[1]
        phases = self.phases
        for phase, (total, count) in report[3].items():
            if count:
                spread = phases.get(phase)
                if spread is None:
                    spread = phases[phase] = Spread()
                spread.add(total / count, rank)
        if len(report) < 5 or not isinstance(report[4], dict):
            return
        extra = report[4]
        peak = extra.get("peak_allocated_mb")
        if isinstance(peak, (int, float)):
            if self.peak is None:
                self.peak = Spread()
            self.peak.add(float(peak), rank)
        counts = extra.get("counts")
        seconds = counts.get("period_ms", 0.0) / 1e3 if isinstance(counts, dict) else 0.0
        if seconds > 0:  # throughput.rates, but steps/s: every rank runs the same steps, the job's is a rank's
            for name in COUNTS:
                if name in counts:
                    key = f"{name}_per_s"
                    self.job[key] = self.job.get(key, 0.0) + counts[name] / seconds

    def merge(self, other: Summary) -> None:
        self.merge_wire(other.wire())

    def merge_wire(self, w: list[Any]) -> None:
        """Merge a summary in its wire form: ``[key, step, ranks, {phase: spread}, peak | None, job]``."""
        self.step = max(self.step, w[1])
        self.ranks += w[2]
        phases = self.phases
        for phase, spread in w[3].items():
            mine = phases.get(phase)
            if mine is None:
                mine = phases[phase] = Spread()
            mine.merge_wire(spread)
        if w[4] is not None:
            if self.peak is None:
                self.peak = Spread()
            self.peak.merge_wire(w[4])
        for k, v in w[5].items():
            self.job[k] = self.job.get(k, 0.0) + v

    def wire(self) -> list[Any]:
        return [self.key, self.step, self.ranks, {p: s.wire() for p, s in self.phases.items()},
                None if self.peak is None else self.peak.wire(), self.job]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Summary:
        s = cls(int(w[0]))
        s.merge_wire(w)
        return s
