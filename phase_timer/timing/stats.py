"""Statistics over resolved steps: exact per logging window, bounded memory per run."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from operator import itemgetter

from phase_timer._env import native_wanted
from phase_timer.phases import share_base

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
    """Mean, p50, p90 and max of some values (exact; sorting sorted values is linear)."""
    ordered = sorted(values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "max": ordered[-1],
    }


class Window:
    """The steps of one logging window: every value kept, exact statistics.

    ``add`` only appends the step's dict; the per-phase columns are built once,
    when the window is written (off the per-step path).
    """

    def __init__(self, key: int) -> None:
        self.key = key
        self.last_step = -1
        self.rows: list[dict[str, float]] = []

    @property
    def steps(self) -> int:
        return len(self.rows)

    def add(self, step: int, ms: dict[str, float]) -> None:
        if step > self.last_step:
            self.last_step = step
        self.rows.append(ms)

    @property
    def values(self) -> dict[str, list[float]]:
        """Each phase's values, in step order."""
        rows = self.rows
        if rows and len(set(map(len, rows))) == 1:
            # The usual window: every step has the same phases; columns built in C.
            try:
                return {p: list(map(itemgetter(p), rows)) for p in rows[0]}
            except KeyError:
                pass
        phases = dict.fromkeys(p for row in rows for p in row)  # first-seen order
        return {p: [row[p] for row in rows if p in row] for p in phases}

    def columns(self) -> dict[str, list[float]]:
        """Each phase's values, sorted: what the statistics and the run totals take."""
        return sorted_columns(self.values)

    def summary(self) -> dict[str, dict[str, float]]:
        """Statistics per phase."""
        return summarize_columns(self.columns())


def sorted_columns(columns: dict[str, list[float]]) -> dict[str, list[float]]:
    """Sort each phase's values in place (once per window); returns ``columns``."""
    for vs in columns.values():
        vs.sort()
    return columns


def summarize_columns(columns: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Statistics per phase of a window's columns (any order; sorted ones sort in linear time)."""
    return {phase: summarize(vs) for phase, vs in columns.items()}


# Run-wide percentiles come from a log-bucketed histogram: buckets 1% wide, so a
# percentile is within 0.5% of the exact one, and memory does not grow with steps.
_GROWTH = 1.01
_INV_LOG_GROWTH = 1.0 / math.log(_GROWTH)
_ZERO = -(10**9)  # the bucket of zero durations


def _bucket(v: float) -> int:
    """floor(log(v) / log(1.01)): the bucket of a positive value."""
    return math.floor(math.log(v) * _INV_LOG_GROWTH)


def _bucket_counts_py(ordered: list[float], into: dict[int, int] | None = None) -> dict[int, int]:
    """Each bucket's count among sorted values (zero and below in ``_ZERO``), added into ``into`` if given."""
    counts: dict[int, int] = {} if into is None else into
    n = len(ordered)
    i = bisect_right(ordered, 0.0)
    if i:
        counts[_ZERO] = counts.get(_ZERO, 0) + i
    # Sorted, a bucket is a run: found by bisecting on the bucket function itself
    # (monotone), so a few logs per bucket the values touch, not one per value,
    # and every value lands exactly where its own log puts it.
    while i < n:
        key = _bucket(ordered[i])
        j = bisect_left(ordered, key + 1, i + 1, n, key=_bucket)
        counts[key] = counts.get(key, 0) + j - i
        i = j
    return counts


def _bucket_counts(ordered: list[float], into: dict[int, int] | None = None) -> dict[int, int]:
    """The same in C, one pass (a window's columns at every window: ~10x less host time)."""
    if into is None:
        return _native_buckets(ordered, _INV_LOG_GROWTH, _ZERO)
    return _native_buckets(ordered, _INV_LOG_GROWTH, _ZERO, into)


def _sorted_stats_py(ordered: list[float], into: dict[int, int]) -> tuple[float, float, float]:
    """Sorted values' sum (left to right), median and 90th percentile; their buckets counted into ``into``."""
    total = 0.0
    for v in ordered:
        total += v
    _bucket_counts_py(ordered, into)
    return total, percentile(ordered, 50), percentile(ordered, 90)


def _sorted_stats(ordered: list[float], into: dict[int, int]) -> tuple[float, float, float]:
    """The same in C, one pass."""
    return _native_sorted_stats(ordered, _INV_LOG_GROWTH, _ZERO, into)


try:
    from phase_timer._native import bucket_counts as _native_buckets
    from phase_timer._native import sorted_stats as _native_sorted_stats
except ImportError:  # not built: the Python ones
    _native_buckets = _native_sorted_stats = None
_native = _native_buckets is not None and native_wanted()
bucket_counts = _bucket_counts if _native else _bucket_counts_py
sorted_stats = _sorted_stats if _native else _sorted_stats_py


class PhaseTotals:
    """Streaming count, sum, min, max and histogram of one phase's milliseconds.

    Attributes:
        count: the steps this phase was timed in.
        total, min, max: milliseconds (sum, smallest, largest); ``mean`` is ``total / count``.

    ``quantile(q)`` is the q-th percentile (0-100) from a log histogram (buckets 1% wide):
    within 0.5% of the exact value, clamped to ``[min, max]``.
    """

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = float("-inf")
        self.min = float("inf")
        self._buckets: dict[int, int] = {}

    def add(self, v: float) -> None:
        self.extend([v])

    def extend(self, values: list[float]) -> None:
        """Count some values, in any order (a sorted copy: linear when sorted already)."""
        if values:
            self.add_sorted(sorted(values))

    def add_sorted(self, ordered: list[float]) -> dict[str, float]:
        """Count a window's sorted values, non-empty (one pass: no copy); returns their statistics, as
        :func:`summarize` computes them."""
        total, p50, p90 = sorted_stats(ordered, self._buckets)
        n = len(ordered)
        self.count += n
        self.total += total
        if ordered[-1] > self.max:
            self.max = ordered[-1]
        if ordered[0] < self.min:
            self.min = ordered[0]
        return {"mean": total / n, "p50": p50, "p90": p90, "max": ordered[-1]}

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
                if key == _ZERO:
                    return max(0.0, self.min)
                return min(max(_GROWTH ** (key + 0.5), self.min), self.max)
        return self.max


class RunTotals:
    """Per-phase totals over a whole run, for the end-of-training summary.

    Fed a window at a time (one call per phase per window, not per step).

    Attributes:
        steps: the timed steps.
        phases: phase name -> :class:`PhaseTotals` (a phase that never happened is absent).
    """

    def __init__(self) -> None:
        self.phases: dict[str, PhaseTotals] = {}
        self.steps = 0

    def add_window(self, steps: int, columns: dict[str, list[float]]) -> None:
        """A window of ``steps`` steps: each phase's values, in any order (sorted copies; a phase with none is
        not counted)."""
        self.add_sorted_window(steps, {phase: sorted(values) for phase, values in columns.items() if values})

    def add_sorted_window(self, steps: int, columns: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        """:meth:`add_window` for sorted columns, each non-empty (the engines' windows), in one pass a phase;
        returns the window's statistics, as :func:`summarize_columns`."""
        self.steps += steps
        phases = self.phases
        summary = {}
        for phase, values in columns.items():
            totals = phases.get(phase)
            if totals is None:
                totals = phases[phase] = PhaseTotals()
            summary[phase] = totals.add_sorted(values)
        return summary

    def share(self, phase: str, base: str | None = None) -> float | None:
        """``phase``'s time over ``base``'s (default: what its share is of, ``phases.share_base``), total over total:
        time-weighted, so a phase absent from some steps (``idle``, a custom phase) is not overstated.  None where
        either is absent or the base holds no time."""
        p, b = self.phases.get(phase), self.phases.get(base or share_base(phase) or "")
        if p is None or b is None or b.total <= 0:
            return None
        return p.total / b.total


#: Statistics a :class:`WindowSeries` keeps per phase and batch.
SERIES_STATS = ("mean", "p50", "p90")


class WindowSeries:
    """Each logging window's mean, p50 and p90 per phase, in bounded memory: the run's own noise.

    ``phase-timer compare`` reads how much a phase's window statistics spread to tell a
    real change from noise (the batch-means method: see :mod:`phase_timer.cli.compare_rows`).
    Windows are kept as they come until there are ``max_batches`` of them; then adjacent
    pairs merge (halving the count, doubling ``windows_per_batch``) and later windows are
    gathered that many to a batch.  A merged batch's mean is exact (weighted by each
    phase's count); its p50 and p90 are its windows' values averaged, count-weighted.
    A batch still filling at the end is left out.  One call per window, never per step.
    """

    def __init__(self, max_batches: int = 256) -> None:
        if max_batches < 2 or max_batches % 2:
            raise ValueError(f"max_batches must be an even number >= 2, got {max_batches}")
        self.max_batches = max_batches
        self.windows_per_batch = 1
        #: Complete batches: (steps, last step, {phase: [count, count-weighted sums of mean, p50, p90]}).
        self.batches: list[tuple[int, int, dict[str, list[float]]]] = []
        self._acc: dict[str, list[float]] = {}  # the batch filling, in the same form
        self._steps = self._last = self._windows = 0

    def add(self, last_step: int, steps: int, summary: dict[str, dict[str, float]], columns: dict[str, list]) -> None:
        """One window: its last step, its steps, each phase's statistics and its values (for their count)."""
        acc = self._acc
        for p, st in summary.items():  # SERIES_STATS written out, in place: a loop building lists costs 4x
            n = len(columns[p])
            a = acc.get(p)
            if a is None:
                acc[p] = [n, n * st["mean"], n * st["p50"], n * st["p90"]]
            else:
                a[0] += n
                a[1] += n * st["mean"]
                a[2] += n * st["p50"]
                a[3] += n * st["p90"]
        self._steps += steps
        self._last = last_step
        self._windows += 1
        if self._windows < self.windows_per_batch:
            return
        self.batches.append((self._steps, self._last, acc))
        self._acc = {}
        self._steps = self._last = self._windows = 0
        if len(self.batches) == self.max_batches:  # rare: once per doubling of the run
            self.batches = [_merge(a, b) for a, b in zip(self.batches[::2], self.batches[1::2])]
            self.windows_per_batch *= 2

    def as_dict(self) -> dict:
        """Columns, one entry per batch (a phase absent from a batch: null)."""
        phases = sorted({p for _, _, ph in self.batches for p in ph})
        cols: dict[str, dict[str, list[float | None]]] = {}
        for p in phases:
            cols[p] = {}
            for i, stat in enumerate(SERIES_STATS, start=1):
                cols[p][f"{stat}_ms"] = [round(ph[p][i] / ph[p][0], 6) if p in ph else None for _, _, ph in self.batches]
        return {
            "windows_per_batch": self.windows_per_batch,
            "steps": [s for s, _, _ in self.batches],
            "last_step": [ls for _, ls, _ in self.batches],
            "phases": cols,
        }


def _merge(a: tuple, b: tuple) -> tuple:
    """Two adjacent batches as one: steps, counts and weighted sums add up; the later last step."""
    phases = {p: list(v) for p, v in a[2].items()}
    for p, v in b[2].items():
        phases[p] = [x + y for x, y in zip(phases[p], v)] if p in phases else list(v)
    return (a[0] + b[0], b[1], phases)
