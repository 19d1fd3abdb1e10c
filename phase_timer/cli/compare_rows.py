"""The rows of ``phase-timer compare``: each phase, memory figure and rate of both sides, its change and noise band.

The band comes from the runs themselves, by batch means (the module docstring of
:mod:`phase_timer.cli.compare` says how); memory has none: its counters are deterministic.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from phase_timer.cli.compare_side import Side
from phase_timer.cli.rates import RATES, headline_rate
from phase_timer.cli.read import CountBatch

#: Width of the band in standard errors of the difference.
Z = 3.0
#: Fewer batches than this on a side: the band is unknown.
MIN_BATCHES = 3


def standard_error(batches: list[tuple[int, float]]) -> float | None:
    """The batch-means standard error of a run's value; None with fewer than MIN_BATCHES full batches."""
    if not batches:
        return None
    half = statistics.median(n for n, _ in batches) / 2
    values = [v for n, v in batches if n >= half]
    if len(values) < MIN_BATCHES:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def rate_relative_error(batches: list[CountBatch]) -> float | None:
    """The relative standard error of a run's rate (its counts over its period) from its window batches.

    A rate is a ratio, ``R = sum(count) / sum(period)``, so the batches give it as a ratio estimator does:
    ``se(R) = sqrt(sum((count_i - R * period_i)**2) / (n * (n - 1))) / mean(period)``, over the batches of at
    least half the median batch's steps, as a phase's band takes them.  With a constant count a step this is,
    to first order, the relative error of the mean ``period``.  None with fewer than MIN_BATCHES batches."""
    if not batches:
        return None
    half = statistics.median(b[0] for b in batches) / 2
    full = [(count, ms) for n, _, count, ms in batches if n >= half]
    if len(full) < MIN_BATCHES:
        return None
    counts, periods = sum(c for c, _ in full), sum(ms for _, ms in full)
    if counts <= 0 or periods <= 0:
        return None
    rate, n = counts / periods, len(full)
    se = math.sqrt(sum((c - rate * ms) ** 2 for c, ms in full) / (n * (n - 1))) / (periods / n)
    return se / rate


@dataclass
class Row:
    phase: str
    baseline_ms: float | None
    candidate_ms: float | None
    delta_ms: float | None
    delta_pct: float | None
    noise_pct: float | None

    @property
    def beyond_noise(self) -> bool | None:
        if self.delta_pct is None or self.noise_pct is None:
            return None
        return abs(self.delta_pct) > self.noise_pct


def compare_phase(phase: str, base: Side, cand: Side, metric: str) -> Row:
    b = base.values.get(phase, {}).get(metric)
    c = cand.values.get(phase, {}).get(metric)
    if b is None or c is None:
        return Row(phase, b, c, None, None, None)
    delta = c - b
    pct = 100.0 * delta / b if b > 0 else None
    se_b = standard_error(base.batches.get(phase, {}).get(metric, []))
    se_c = standard_error(cand.batches.get(phase, {}).get(metric, []))
    noise = None
    if se_b is not None and se_c is not None and b > 0:
        noise = 100.0 * Z * math.hypot(se_b, se_c) / b
    return Row(phase, b, c, delta, pct, noise)


#: The memory table's rows, in order: the run's peaks, and the mean of what forward keeps for backward.
MEMORY_ROWS = {"peak_allocated": "peak allocated", "peak_reserved": "peak reserved", "activations": "activations mean"}


def memory_value(memory: dict[str, Any] | None, what: str) -> float | None:
    """One of :data:`MEMORY_ROWS` (MB) from a side's memory object; None where memory was not read."""
    if not memory or not memory.get("samples"):
        return None
    if what == "activations":
        act = (memory.get("allocated_mb") or {}).get("activations")
        return act["mean"] if act else None
    return memory.get(f"{what}_mb")


@dataclass
class MemoryRow:
    what: str
    baseline_mb: float | None
    candidate_mb: float | None

    @property
    def delta_mb(self) -> float | None:
        if self.baseline_mb is None or self.candidate_mb is None:
            return None
        return self.candidate_mb - self.baseline_mb

    @property
    def delta_pct(self) -> float | None:
        delta = self.delta_mb
        if delta is None or self.baseline_mb is None or self.baseline_mb <= 0:
            return None
        return 100.0 * delta / self.baseline_mb


def memory_rows(base: Side, cand: Side) -> dict[str, MemoryRow] | None:
    """The memory table, when both sides have memory data (None otherwise: one side alone compares to nothing)."""
    if memory_value(base.memory, "peak_allocated") is None or memory_value(cand.memory, "peak_allocated") is None:
        return None
    return {w: MemoryRow(w, memory_value(base.memory, w), memory_value(cand.memory, w)) for w in MEMORY_ROWS}


def memory_exceeds(row: MemoryRow, pct: float) -> bool:
    """The candidate's value higher than the baseline's by more than ``pct`` percent (a zero baseline: any rise)."""
    if row.delta_pct is None:
        return (row.delta_mb or 0.0) > 0
    return row.delta_pct > pct


@dataclass
class RateRow:
    """One throughput row: a rate or an MFU, higher is better."""

    what: str
    baseline: float | None
    candidate: float | None
    noise_pct: float | None = None

    @property
    def delta_pct(self) -> float | None:
        if self.baseline is None or self.candidate is None or self.baseline <= 0:
            return None
        return 100.0 * (self.candidate - self.baseline) / self.baseline

    @property
    def beyond_noise(self) -> bool | None:
        delta = self.delta_pct
        if delta is None or self.noise_pct is None:
            return None
        return abs(delta) > self.noise_pct


#: The throughput table's rows past the rates: (label, where in the ``throughput`` or ``flops`` object).
_JOB_ROWS = {"job tokens/s": ("job", "tokens_per_s"), "job samples/s": ("job", "samples_per_s")}
_FLOPS_ROWS = {"TFLOP/s": (None, "tflops_per_s"), "MFU": ("mfu", "step"), "MFU forward": ("mfu", "forward"),
               "MFU backward": ("mfu", "backward")}


def number_at(obj: dict[str, Any] | None, where: str | None, key: str) -> float | None:
    """A number of a side's ``throughput`` or ``flops`` object: ``obj[where][key]`` (``obj[key]`` without
    ``where``); None where it is absent."""
    inner = (obj or {}).get(where) if where else obj
    value = (inner or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def compare_rate(name: str, base: Side, cand: Side) -> RateRow:
    """A rate of both sides, with the band of its difference from each run's window batches (``Z`` standard errors
    of the difference, as a phase's band, in % of the baseline)."""
    b, c = number_at(base.throughput, None, name), number_at(cand.throughput, None, name)
    row = RateRow(RATES[name], b, c)
    rel_b = rate_relative_error(base.rate_batches.get(name, []))
    rel_c = rate_relative_error(cand.rate_batches.get(name, []))
    if b is not None and c is not None and b > 0 and rel_b is not None and rel_c is not None:
        row.noise_pct = 100.0 * Z * math.hypot(b * rel_b, c * rel_c) / b
    return row


def throughput_rows(base: Side, cand: Side) -> dict[str, RateRow] | None:
    """The throughput table, when both sides counted their batches (None otherwise)."""
    if not base.throughput or not cand.throughput:
        return None
    rows = {RATES[n]: compare_rate(n, base, cand) for n in RATES
            if number_at(base.throughput, None, n) is not None or number_at(cand.throughput, None, n) is not None}
    for table, obj in ((_JOB_ROWS, "throughput"), (_FLOPS_ROWS, "flops")):
        for label, (where, key) in table.items():
            b, c = number_at(getattr(base, obj), where, key), number_at(getattr(cand, obj), where, key)
            if b is not None or c is not None:
                rows[label] = RateRow(label, b, c)
    return rows


def gated_rate(base: Side, cand: Side) -> str:
    """The rate the throughput gate reads: tokens/s when both sides count tokens, else samples/s."""
    both = [headline_rate(s.throughput) for s in (base, cand)]
    return "tokens_per_s" if both == ["tokens_per_s"] * 2 else "samples_per_s"
