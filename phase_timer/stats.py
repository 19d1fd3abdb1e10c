"""Statistics over resolved steps: exact per logging window, bounded memory per run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Statistics written per phase for each window, in this order.
WINDOW_STATS = ("mean", "p50", "p90", "max")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation, as ``numpy.percentile``."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Mean, p50, p90 and max of some values (exact)."""
    ordered = sorted(values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "max": ordered[-1],
    }


class Window:
    """The steps of one logging window: every value kept, exact statistics."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.last_step = -1
        self.values: dict[str, list[float]] = {}

    def add(self, step: int, ms: dict[str, float]) -> None:
        self.last_step = max(self.last_step, step)
        values = self.values
        for phase, v in ms.items():
            bucket = values.get(phase)
            if bucket is None:
                values[phase] = [v]
            else:
                bucket.append(v)

    def summary(self) -> dict[str, dict[str, float]]:
        return {phase: summarize(vs) for phase, vs in self.values.items()}


# Run-wide percentiles come from a log-bucketed histogram: buckets 1% wide, so a
# percentile is within 0.5% of the exact one, and memory does not grow with steps.
_GROWTH = 1.01
_LOG_GROWTH = math.log(_GROWTH)


@dataclass
class PhaseTotals:
    """Streaming count, sum, max and histogram of one phase's milliseconds."""

    count: int = 0
    total: float = 0.0
    max: float = float("-inf")
    min: float = float("inf")

    def __post_init__(self) -> None:
        self._buckets: dict[int, int] = {}

    def add(self, v: float) -> None:
        self.count += 1
        self.total += v
        self.max = v if v > self.max else self.max
        self.min = v if v < self.min else self.min
        key = math.floor(math.log(v) / _LOG_GROWTH) if v > 0 else -(10**9)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    @property
    def mean(self) -> float:
        return self.total / self.count

    def quantile(self, q: float) -> float:
        """Approximate ``q``-th percentile (0-100): the geometric middle of its bucket."""
        rank = q / 100.0 * (self.count - 1)
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                if key == -(10**9):
                    return max(0.0, self.min)
                mid = _GROWTH ** (key + 0.5)
                return min(max(mid, self.min), self.max)
        return self.max


class RunTotals:
    """Per-phase totals over a whole run, for the end-of-training summary."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseTotals] = {}
        self.steps = 0

    def add(self, ms: dict[str, float]) -> None:
        self.steps += 1
        phases = self.phases
        for phase, v in ms.items():
            totals = phases.get(phase)
            if totals is None:
                totals = phases[phase] = PhaseTotals()
            totals.add(v)
