"""``phase-timer compare BASELINE CANDIDATE``: is the candidate slower, where, and beyond noise?

Usage::

    phase-timer compare BASELINE CANDIDATE [--metric mean|p50|p90] [--fail-above PCT]
                        [--fail-above-memory PCT] [--fail-below-throughput PCT]
                        [--phase NAME ...] [--json]

Each side is a run directory (its ``phase_timer_summary.json``, else its TensorBoard
files) or a summary file.  Where a side has no summary file (a run from before it
existed) its numbers come from the TensorBoard windows, and the output says so.

The noise band (batch means).  A run's logging windows are consecutive batches of
steps; the spread of a phase's window statistic from batch to batch says how much
that statistic moves by chance *within the run*.  For each side, the standard error
of the run's value is ``stdev(batch values) / sqrt(batches)``; the band of the
difference is ``Z * sqrt(se_baseline**2 + se_candidate**2)``, as a percentage of
the baseline (``Z`` = 3: about 99.7% for a normal spread).  Batches shorter
than half the median batch (a last, partial window) are left out; with fewer than
3 batches on a side the band is unknown.  Noise *between* runs (a
different machine, GPU clocks, a busier host) is not in it: that is what the
threshold is for.

The gate.  ``--fail-above PCT`` (off by default) checks ``step``, or each ``--phase``:
exit status 1 when the candidate's value is higher by more than ``PCT`` percent **and**
beyond the band (a phase whose band is unknown is gated on ``PCT`` alone, and the
output says so); 0 otherwise; 2 on bad input (a missing or corrupt run, no phase-timer
data, a gated phase missing on one side, runs on different clocks), with one line on
stderr.  Warnings (stderr) name what makes the runs hard to compare: a different
device, torch, world size, precision, batch size, door or set of phases.

Memory (CUDA runs).  When both sides have memory data, a memory table follows
(peak allocated, peak reserved, mean activations: baseline, candidate, change); from
a summary file its ``memory`` object, from TensorBoard alone the last
``phase_memory/*`` points and the mean of the activations'.  ``--fail-above-memory
PCT`` (off by default) gates the peak allocated: exit status 1 when the candidate's
is higher than the baseline's by more than ``PCT`` percent; 0 otherwise; 2 (one line
on stderr naming the path) when a side has no memory data (a CPU run, the host
clock, ``memory=False``).  It has no noise band: the allocator's counters are
deterministic in a steady loop (the same allocations in the same order give the same
bytes), so a difference is a change, not chance.

Throughput.  When both sides counted their batches, a throughput table follows: tokens/s,
samples/s, steps/s (this rank's; under torch.distributed the job's too), and from version-6
summary files TFLOP/s and MFU (step, forward, backward), each with its change.  A rate is a
ratio (counts over ``period``), so its band comes from the window batches' counts and periods
as a ratio estimator's: ``se(R) = sqrt(sum((count_i - R * period_i)**2) / (n * (n - 1))) /
mean(period_i)``, then ``Z`` of them for the difference, as for a phase.  A summary file keeps
each batch's steps and mean ``period``; where every step had the same count
(``throughput.per_step``) a batch's count is that count times its steps (the band is then, to
first order, the mean period's); TensorBoard keeps each window's rate.  A count that varied
from step to step, with no TensorBoard files beside the summary file, leaves the band unknown.
``--fail-below-throughput PCT`` (off by default) gates tokens/s (samples/s where a side counts
no tokens), this rank's: exit status 1 when the candidate's is lower by more than ``PCT``
percent **and** beyond the band (unknown: on ``PCT`` alone, and said); 2 when a side has no
throughput.  MFU is shown, not gated: for the same model on the same device it moves with
tokens/s, and a change of FLOP count or peak between the runs (warned) moves it with no change
in speed.  Any gate failing exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phase_timer.phases import TOTALS, ordered, share_base
from phase_timer.rank_view import RankRow, compare_ranks, format_rank_comparison, rank_verdicts
from phase_timer.run_summary import FILE_NAME
from phase_timer.runs import (
    ReportError,
    check_event_file,
    read_phase_scalars,
    read_summary,
    require,
    run_dirs,
    CountBatch,
    summary_count_batches,
    tensorboard_count_batches,
    tensorboard_flops,
    tensorboard_memory,
    tensorboard_throughput,
)
from phase_timer.stats import SERIES_STATS, percentile
from phase_timer.throughput_report import RATES, format_rate, headline_rate

#: Width of the band in standard errors of the difference.
Z = 3.0
#: Fewer batches than this on a side: the band is unknown.
MIN_BATCHES = 3
METRICS = SERIES_STATS  # what each window batch keeps is what can be compared
#: The summary file versions this reads (1 has no window columns: its band comes from TensorBoard).
EXIT_SLOWER = 1


@dataclass
class Side:
    """One run as ``compare`` reads it."""

    path: str
    #: "summary" (the run's own totals), "per-step" or "windows" (TensorBoard fallbacks).
    source: str
    steps: int | None
    clock: str | None
    #: phase -> metric -> the run's value (ms).
    values: dict[str, dict[str, float]]
    #: phase -> metric -> one value per batch of windows (ms), with each batch's steps.
    batches: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    #: Where the batches came from, when not from the summary file.
    batches_from: str | None = None
    environment: dict[str, Any] | None = None
    door: str | None = None
    interrupted: bool = False
    #: The summary file's ``memory`` object, or TensorBoard's (:func:`~phase_timer.runs.tensorboard_memory`); None:
    #: memory was not read.
    memory: dict[str, Any] | None = None
    #: The summary file's ``throughput`` object, or TensorBoard's; None: no batch was counted.
    throughput: dict[str, Any] | None = None
    #: rate name (``tokens_per_s`` ...) -> each batch of windows' steps, last step, count and period (ms).
    rate_batches: dict[str, list[CountBatch]] = field(default_factory=dict)
    #: The summary file's ``flops`` object (version 6), or what TensorBoard has of it; None: none.
    flops: dict[str, Any] | None = None
    #: What the run's own diagnosis says changed partway through it (RUN_CHANGED's ``why``): its means mix levels.
    changed: list[str] = field(default_factory=list)
    #: The summary file's ``ranks`` block (each rank's means; None: one process, or TensorBoard's).
    ranks: dict[str, Any] | None = None


# -- reading a side ---------------------------------------------------------------------
def load_side(path: str) -> Side:
    """A run directory or a summary file; the TensorBoard windows where no summary file is.

    Bad input is a :class:`~phase_timer.runs.ReportError`: one line on stderr, exit status 2.
    """
    if not os.path.exists(path):
        raise ReportError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        return _from_summary(path, read_summary(path))
    runs = run_dirs(path)
    direct = runs.get(os.path.normpath(path), ([], None))[1]  # the run's own summary, before any below it
    summaries = [direct] if direct else [s for _, s in runs.values() if s]
    if len(summaries) > 1:
        shown = ", ".join(summaries[:3]) + (", ..." if len(summaries) > 3 else "")
        raise ReportError(f"{path}: holds {len(summaries)} run summaries ({shown}); name one run")
    if summaries:
        return _from_summary(summaries[0], read_summary(summaries[0]))
    return _tensorboard_side(path, runs)


def _from_summary(path: str, data: dict[str, Any]) -> Side:
    phases = data.get("phases") or {}
    values = {
        p: {m: float(row[f"{m}_ms"]) for m in METRICS if isinstance(row.get(f"{m}_ms"), (int, float))}
        for p, row in phases.items()
    }
    steps = (data.get("steps") or {}).get("timed")
    if not steps or not values:
        raise ReportError(f"{path}: the run timed no steps ({(data.get('steps') or {}).get('untimed_reason') or 'none'})")
    env = data.get("environment") or {}
    side = Side(path=path, source="summary", steps=steps, clock=env.get("clock"), values=values,
                environment=env, door=data.get("door"), interrupted=bool(data.get("interrupted")),
                memory=data.get("memory"), throughput=data.get("throughput"), flops=data.get("flops"),
                changed=_changes(data.get("diagnosis")), ranks=data.get("ranks"))
    windows = data.get("windows")
    if windows:
        side.batches = _summary_batches(windows)
        side.rate_batches = summary_count_batches(data)
        _rate_batches_beside(side)
        return side
    # A version-1 file: its windows are in the TensorBoard files beside it, if there are any.
    side.batches_from = "none (a version-1 summary file and no TensorBoard files beside it)"
    try:
        side.batches = _tensorboard_side(path, run_dirs(path)).batches
        side.batches_from = "TensorBoard windows beside the summary file"
    except ReportError:
        pass
    return side


def _changes(diagnosis: dict[str, Any] | None) -> list[str]:
    """RUN_CHANGED's words in a summary's diagnosis (the verdict or one of the findings beside it)."""
    if not diagnosis:
        return []
    found = [diagnosis, *(diagnosis.get("secondary") or ())]
    return [f["why"] for f in found if f.get("kind") == "RUN_CHANGED" and f.get("why")]


def _rate_batches_beside(side: Side) -> None:
    """A headline rate the summary file cannot give batches of (its count varied from step to step, or a file
    from before ``per_step``): each window's rate from the TensorBoard files beside it, where there are any."""
    name = headline_rate(side.throughput)
    if name is None or side.rate_batches.get(name):
        return
    try:
        side.rate_batches[name] = _tensorboard_side(side.path, run_dirs(side.path)).rate_batches.get(name, [])
    except ReportError:
        pass


def _summary_batches(windows: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    steps = windows.get("steps") or []
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for p, cols in (windows.get("phases") or {}).items():
        out[p] = {m: [(n, v) for n, v in zip(steps, cols.get(f"{m}_ms") or []) if v is not None] for m in METRICS}
    return out


def _tensorboard_side(path: str, runs: dict[str, tuple[list[str], str | None]]) -> Side:
    """A run's values and batches from its TensorBoard files (``runs``: :func:`run_dirs` of ``path``; one run only)."""
    found = []
    for run_dir, (files, _) in runs.items():
        for f in files:
            check_event_file(f)
        scalars = read_phase_scalars(run_dir) if files else None
        if scalars is not None and not scalars.empty:
            found.append((run_dir, scalars))
    if not found:
        raise ReportError(f"{path}: no {FILE_NAME} and no phase-timer scalars in its TensorBoard files")
    if len(found) > 1:
        raise ReportError(f"{path}: holds {len(found)} phase-timer runs ({', '.join(d for d, _ in found[:3])}); name one")
    run_dir, scalars = found[0]
    window_steps = dict(scalars.window_steps)
    batches: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for p, stats in scalars.window.items():
        batches[p] = {m: [(int(window_steps.get(s, 1)), v) for s, v in stats.get(m, [])] for m in METRICS}
    if scalars.step:  # per-step values: the run's exact statistics
        values = {}
        for p, pts in scalars.step.items():
            vs = sorted(v for _, v in pts)
            values[p] = {"mean": statistics.fmean(vs), "p50": percentile(vs, 50), "p90": percentile(vs, 90)}
        steps: int | None = len({s for pts in scalars.step.values() for s, _ in pts})
        source = "per-step"
    else:  # window statistics only: step-weighted means; p50 and p90 the windows' averaged
        values = {p: {m: _weighted(b[m]) for m in METRICS if b[m]} for p, b in batches.items()}
        steps = int(sum(window_steps.values())) or None
        source = "windows"
    return Side(path=run_dir, source=source, steps=steps, clock=None, values=values, batches=batches,
                memory=tensorboard_memory(scalars), throughput=tensorboard_throughput(scalars),
                rate_batches=tensorboard_count_batches(scalars), flops=tensorboard_flops(scalars))


def _weighted(batches: list[tuple[int, float]]) -> float:
    total = sum(n for n, _ in batches)
    return sum(n * v for n, v in batches) / total


# -- the comparison ---------------------------------------------------------------------
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
_NO_BAND = "no noise band: the allocator's counters are deterministic in a steady loop"


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


def _require_memory(side: Side) -> None:
    if memory_value(side.memory, "peak_allocated") is None:
        raise ReportError(f"{side.path}: no memory data for --fail-above-memory (memory is read on CUDA only: "
                          "not on a CPU or the host clock, nor with memory=False)")


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


def _get(obj: dict[str, Any] | None, where: str | None, key: str) -> float | None:
    inner = (obj or {}).get(where) if where else obj
    value = (inner or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def compare_rate(name: str, base: Side, cand: Side) -> RateRow:
    """A rate of both sides, with the band of its difference from each run's window batches (``Z`` standard errors
    of the difference, as a phase's band, in % of the baseline)."""
    b, c = _get(base.throughput, None, name), _get(cand.throughput, None, name)
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
            if _get(base.throughput, None, n) is not None or _get(cand.throughput, None, n) is not None}
    for table, obj in ((_JOB_ROWS, "throughput"), (_FLOPS_ROWS, "flops")):
        for label, (where, key) in table.items():
            b, c = _get(getattr(base, obj), where, key), _get(getattr(cand, obj), where, key)
            if b is not None or c is not None:
                rows[label] = RateRow(label, b, c)
    return rows


def gated_rate(base: Side, cand: Side) -> str:
    """The rate the throughput gate reads: tokens/s when both sides count tokens, else samples/s."""
    both = [headline_rate(s.throughput) for s in (base, cand)]
    return "tokens_per_s" if both == ["tokens_per_s"] * 2 else "samples_per_s"


def _require_throughput(side: Side) -> None:
    if not side.throughput:
        raise ReportError(f"{side.path}: no throughput for --fail-below-throughput (no batch was counted: pass "
                          "samples_per_batch= or tokens_per_batch=, or a run from before phase-timer counted them)")


def rate_verdict(row: RateRow) -> str:
    """"tokens/s -8.1% lower (beyond noise ±1.0%)", or within noise, or noise unknown."""
    delta = row.delta_pct
    if delta is None:
        return f"{row.what}: not comparable (a zero or missing baseline)"
    way = "lower" if delta < 0 else "higher"
    if row.noise_pct is None:
        return (f"{row.what} {delta:+.1f}% {way} (noise unknown: too few windows, or a count that varied from step "
                "to step with no TensorBoard windows beside the file)")
    if row.beyond_noise:
        return f"{row.what} {delta:+.1f}% {way} (beyond noise ±{row.noise_pct:.1f}%)"
    return f"{row.what} {delta:+.1f}%, within noise ±{row.noise_pct:.1f}%: no change beyond noise"


@dataclass
class Comparison:
    base: Side
    cand: Side
    metric: str
    rows: dict[str, Row]
    gated: list[str]
    fail_above: float | None
    warnings: list[str]
    failed: list[str]
    verdicts: list[str]
    #: The memory table (both sides with memory data), the memory gate's threshold and its outcome.
    memory: dict[str, MemoryRow] | None = None
    fail_above_memory: float | None = None
    memory_failed: bool = False
    #: The throughput table (both sides with throughput), the rate gated, the gate's threshold and its outcome.
    throughput: dict[str, RateRow] | None = None
    throughput_gated: str | None = None
    fail_below_throughput: float | None = None
    throughput_failed: bool = False
    #: Each phase's slowest rank on both sides (``rank_view``); None: a side ran in one process.
    ranks: list[RankRow] | None = None


def parts_of(phase: str, rows: dict[str, Row]) -> list[str]:
    """The phases that make up a total: the step's phases for ``step``, everything in the period for ``period``."""
    if phase == "step":
        return [p for p in rows if share_base(p) == "step"]
    if phase == "period":
        return [p for p in rows if p not in TOTALS]
    return []


def verdict_line(phase: str, row: Row, rows: dict[str, Row], metric: str) -> str:
    """"step +7.9% slower (beyond noise ±1.2%): backward +12.4%, optimizer +0.3%"."""
    name = phase if metric == "mean" else f"{phase} {metric}"
    if row.delta_pct is None:
        return f"{name}: not comparable (a zero or missing baseline)"
    pct = f"{row.delta_pct:+.1f}%"
    if row.noise_pct is None:
        head = f"{name} {pct} {'slower' if row.delta_pct > 0 else 'faster'} (noise unknown: too few windows)"
    elif row.beyond_noise:
        head = f"{name} {pct} {'slower' if row.delta_pct > 0 else 'faster'} (beyond noise ±{row.noise_pct:.1f}%)"
    else:
        return f"{name} {pct}, within noise ±{row.noise_pct:.1f}%: no change beyond noise"
    parts = [rows[p] for p in parts_of(phase, rows) if rows[p].delta_pct is not None]
    if not parts:
        return head
    parts.sort(key=lambda r: -abs(r.delta_ms or 0.0))
    moved = [r for r in parts if r.beyond_noise is not False]
    if not moved:
        return head + ": no phase of it beyond its own noise"
    shown = ", ".join(f"{r.phase} {r.delta_pct:+.1f}% ({r.delta_ms:+.3f} ms)" for r in moved[:3])
    if len(moved) > 3:
        shown += f"; {len(moved) - 3} more beyond noise"
    return head + ": " + shown + ("; the rest within noise" if len(parts) > len(moved) else "")


def comparability(base: Side, cand: Side, phases_b: set[str], phases_c: set[str]) -> list[str]:
    """What makes the two runs hard to compare (warnings)."""
    out = []
    for side in (base, cand):
        if side.source != "summary":
            what = "per-step values" if side.source == "per-step" else "window summaries"
            out.append(f"{side.path}: no {FILE_NAME}; its numbers come from the TensorBoard {what}")
        elif side.batches_from:
            out.append(f"{side.path}: noise band from {side.batches_from}")
        if side.interrupted:
            out.append(f"{side.path}: the run was interrupted; its numbers cover the steps before that")
    eb, ec = base.environment or {}, cand.environment or {}
    checks = (("device", "device"), ("torch", "torch version"), ("world_size", "world size"),
              ("precision", "precision"), ("cuda", "CUDA version"))
    for key, label in checks:
        if eb and ec and eb.get(key) != ec.get(key):
            out.append(f"different {label}: baseline {eb.get(key)!r}, candidate {ec.get(key)!r}")
    bb, bc = ((e.get("loader") or {}).get("batch_size") for e in (eb, ec))
    if bb is not None and bc is not None and bb != bc:
        out.append(f"different batch size: baseline {bb}, candidate {bc}")
    if base.door and cand.door and base.door != cand.door:
        out.append(f"different doors: baseline {base.door}, candidate {cand.door} (their boundaries differ slightly)")
    if phases_b != phases_c:
        only_b, only_c = sorted(phases_b - phases_c), sorted(phases_c - phases_b)
        what = "; ".join(s for s in (f"only the baseline has {', '.join(only_b)}" if only_b else "",
                                     f"only the candidate has {', '.join(only_c)}" if only_c else "") if s)
        out.append(f"different phases: {what}")
    if base.source != cand.source and "summary" in (base.source, cand.source):
        out.append("one side from its summary file, the other from TensorBoard: p50 and p90 are estimated differently")
    mem = [memory_value(s.memory, "peak_allocated") is not None for s in (base, cand)]
    if mem[0] != mem[1]:
        without = cand if mem[0] else base
        out.append(f"{without.path}: no memory data; memory is compared only when both sides have it")
    return out + _throughput_warnings(base, cand)


def _throughput_warnings(base: Side, cand: Side) -> list[str]:
    """What makes the two runs' rates and MFU hard to compare."""
    if bool(base.throughput) != bool(cand.throughput):
        without = cand if base.throughput else base
        return [f"{without.path}: no throughput (no batch was counted); throughput is compared only when both "
                "sides have it"]
    if not base.throughput:
        return []
    out = []
    heads = [headline_rate(s.throughput) for s in (base, cand)]
    if heads[0] != heads[1]:
        which = "baseline" if heads[0] == "tokens_per_s" else "candidate"
        out.append(f"only the {which} counts tokens: samples/s is the throughput compared")
    fb, fc = (_get(s.flops, "per_step", "model") for s in (base, cand))
    if fb and fc and abs(fc - fb) > 0.01 * fb:
        out.append(f"different FLOPs a step: baseline {fb:.4g}, candidate {fc:.4g} (another model or batch): their "
                   "rates and MFU measure unlike steps")
    pb, pc = ((s.flops or {}).get("peak") for s in (base, cand))
    if pb and pc and (pb.get("tflops"), pb.get("precision")) != (pc.get("tflops"), pc.get("precision")):
        out.append(f"different MFU peaks: baseline {pb.get('tflops'):g} TFLOP/s {pb.get('precision') or ''}, "
                   f"candidate {pc.get('tflops'):g} TFLOP/s {pc.get('precision') or ''}".rstrip())
    return out


def compare(base: Side, cand: Side, *, metric: str = "mean", gated: Sequence[str] = ("step",),
            fail_above: float | None = None, fail_above_memory: float | None = None,
            fail_below_throughput: float | None = None) -> Comparison:
    if fail_above_memory is not None:  # a gate on data one side lacks is bad input, not a pass
        _require_memory(base)
        _require_memory(cand)
    if fail_below_throughput is not None:
        _require_throughput(base)
        _require_throughput(cand)
    if base.clock and cand.clock and base.clock != cand.clock:
        raise ReportError(f"the baseline was timed on the {base.clock} clock and the candidate on the {cand.clock} "
                           "clock: their phases do not measure the same thing")
    pb, pc = set(base.values), set(cand.values)
    for phase in gated:
        for side, have in ((base, pb), (cand, pc)):
            if phase not in have:
                raise ReportError(f"phase {phase!r} is not in {side.path} (it has: {', '.join(ordered(list(have)))})")
    rows = {p: compare_phase(p, base, cand, metric) for p in ordered(list(pb | pc))}
    failed = []
    if fail_above is not None:
        for phase in gated:
            r = rows[phase]
            if r.delta_pct is not None and r.delta_pct > fail_above and r.beyond_noise is not False:
                failed.append(phase)
    memory = memory_rows(base, cand)
    memory_failed = fail_above_memory is not None and memory is not None and memory_exceeds(
        memory["peak_allocated"], fail_above_memory)
    verdicts = [verdict_line(p, rows[p], rows, metric) for p in gated]
    rates = throughput_rows(base, cand)
    rate_name = gated_rate(base, cand) if rates is not None else None
    rate_row = rates.get(RATES[rate_name]) if rates is not None and rate_name else None
    if rate_row is not None:
        verdicts.append(rate_verdict(rate_row))
    rate_failed = (fail_below_throughput is not None and rate_row is not None and rate_row.delta_pct is not None
                   and rate_row.delta_pct < -fail_below_throughput and rate_row.beyond_noise is not False)
    ranks = compare_ranks(base.ranks, cand.ranks)
    verdicts += rank_verdicts(ranks)
    return Comparison(base, cand, metric, rows, list(gated), fail_above, comparability(base, cand, pb, pc), failed,
                      verdicts, memory, fail_above_memory, memory_failed, rates, rate_name, fail_below_throughput,
                      rate_failed, ranks)


# -- output ------------------------------------------------------------------------------
def _num(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def format_comparison(c: Comparison) -> str:
    from tabulate import tabulate

    rows = []
    for r in c.rows.values():
        mark = "" if r.beyond_noise is None else ("slower" if r.delta_ms > 0 else "faster") if r.beyond_noise else "~"
        rows.append((r.phase, _num(r.baseline_ms, ".3f"), _num(r.candidate_ms, ".3f"), _num(r.delta_ms, "+.3f"),
                     _num(r.delta_pct, "+.1f"), "" if r.noise_pct is None else f"±{r.noise_pct:.1f}", mark))
    heads = ("phase", f"baseline {c.metric} ms", f"candidate {c.metric} ms", "delta ms", "delta %", "noise %",
             "verdict")
    table = tabulate(rows, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 5 + ("left",))
    lines = [f"baseline:  {_describe(c.base)}", f"candidate: {_describe(c.cand)}", table,
             "noise: the band of the difference, 3 standard errors from each run's window-to-window spread "
             "(~ within noise; blank: too few windows)"]
    if c.memory is not None:
        lines.append(format_memory_table(c.memory))
    if c.throughput is not None:
        lines.append(format_throughput_table(c.throughput))
    if c.ranks:
        lines.append(format_rank_comparison(c.ranks))
    lines += c.verdicts
    for name, side in (("baseline", c.base), ("candidate", c.cand)):
        lines += [f"the {name} changed partway through its run: {why} (its figures mix both levels)" for why in side.changed]
    if c.fail_above is not None:
        lines.append(_gate_line(c))
    if c.fail_above_memory is not None:
        lines.append(_memory_gate_line(c))
    if c.fail_below_throughput is not None:
        lines.append(_throughput_gate_line(c))
    return "\n".join(lines)


def _rate(label: str, v: float | None) -> str:
    if v is None:
        return ""
    return f"{100 * v:.1f}%" if label.startswith("MFU") else format_rate(v)


def format_throughput_table(rows: dict[str, RateRow]) -> str:
    from tabulate import tabulate

    body = []
    for label, r in rows.items():
        way = "lower" if (r.delta_pct or 0.0) < 0 else "higher"
        mark = "" if r.beyond_noise is None else way if r.beyond_noise else "~"
        body.append((label, _rate(label, r.baseline), _rate(label, r.candidate), _num(r.delta_pct, "+.1f"),
                     "" if r.noise_pct is None else f"±{r.noise_pct:.1f}", mark))
    heads = ("throughput", "baseline", "candidate", "delta %", "noise %", "")
    return tabulate(body, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 4 + ("left",))


def _throughput_gate_line(c: Comparison) -> str:
    assert c.throughput is not None and c.throughput_gated is not None  # compare() raised otherwise
    row = c.throughput[RATES[c.throughput_gated]]
    if c.throughput_failed:
        return f"FAIL: {row.what} lower by more than {c.fail_below_throughput:g}% and beyond noise"
    note = " (noise unknown, gated on the threshold alone)" if row.noise_pct is None else ""
    return f"pass: {row.what} not lower by more than {c.fail_below_throughput:g}% beyond noise{note}"


def format_memory_table(rows: dict[str, MemoryRow]) -> str:
    from tabulate import tabulate

    body = [(MEMORY_ROWS[r.what], _num(r.baseline_mb, ".1f"), _num(r.candidate_mb, ".1f"), _num(r.delta_mb, "+.1f"),
             _num(r.delta_pct, "+.1f")) for r in rows.values()]
    heads = ("memory", "baseline MiB", "candidate MiB", "delta MiB", "delta %")
    return tabulate(body, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 4)


def _memory_gate_line(c: Comparison) -> str:
    assert c.memory is not None  # the gate needs both sides' memory: compare() raised otherwise
    row = c.memory["peak_allocated"]
    change = f"{row.delta_pct:+.1f}%" if row.delta_pct is not None else f"{row.delta_mb:+.1f} MiB"
    what = f"peak allocated {change} ({row.baseline_mb:.1f} -> {row.candidate_mb:.1f} MiB)"
    if c.memory_failed:
        return f"FAIL: {what}, more than {c.fail_above_memory:g}% ({_NO_BAND})"
    return f"pass: {what}, not more than {c.fail_above_memory:g}% ({_NO_BAND})"


def _describe(side: Side) -> str:
    what = {"summary": FILE_NAME, "per-step": "TensorBoard per-step values", "windows": "TensorBoard windows"}[side.source]
    steps = f"{side.steps} steps" if side.steps else "steps unknown"
    return f"{side.path} ({what}, {steps})"


def _gate_line(c: Comparison) -> str:
    if c.failed:
        names = ", ".join(p if c.metric == "mean" else f"{p} {c.metric}" for p in c.failed)
        return f"FAIL: {names} slower by more than {c.fail_above:g}% and beyond noise"
    unknown = [p for p in c.gated if c.rows[p].noise_pct is None]
    note = f" ({', '.join(unknown)}: noise unknown, gated on the threshold alone)" if unknown else ""
    return f"pass: no gated phase ({', '.join(c.gated)}) slower by more than {c.fail_above:g}% beyond noise{note}"


def to_json(c: Comparison) -> dict[str, Any]:
    def side(s: Side) -> dict[str, Any]:
        return {"path": s.path, "source": s.source, "steps": s.steps, "clock": s.clock}

    return {
        "metric": c.metric,
        "baseline": side(c.base),
        "candidate": side(c.cand),
        "phases": {p: {"baseline_ms": r.baseline_ms, "candidate_ms": r.candidate_ms, "delta_ms": r.delta_ms,
                       "delta_pct": r.delta_pct, "noise_pct": r.noise_pct, "beyond_noise": r.beyond_noise}
                   for p, r in c.rows.items()},
        "gate": {"phases": c.gated, "fail_above_pct": c.fail_above, "failed": c.failed,
                 "fail_above_memory_pct": c.fail_above_memory, "memory_failed": c.memory_failed,
                 "throughput": c.throughput_gated, "fail_below_throughput_pct": c.fail_below_throughput,
                 "throughput_failed": c.throughput_failed},
        "memory": None if c.memory is None else {
            w: {"baseline_mb": r.baseline_mb, "candidate_mb": r.candidate_mb, "delta_mb": r.delta_mb,
                "delta_pct": r.delta_pct} for w, r in c.memory.items()},
        "throughput": None if c.throughput is None else {
            label: {"baseline": r.baseline, "candidate": r.candidate, "delta_pct": r.delta_pct,
                    "noise_pct": r.noise_pct, "beyond_noise": r.beyond_noise} for label, r in c.throughput.items()},
        "verdicts": c.verdicts,
        "changed": {"baseline": c.base.changed, "candidate": c.cand.changed},
        "ranks": None if c.ranks is None else {
            r.phase: {"baseline_ms": r.base_ms, "baseline_rank": r.base_rank, "candidate_ms": r.cand_ms,
                      "candidate_rank": r.cand_rank, "delta_pct": r.delta_pct, "rank0_delta_pct": r.zero_pct}
            for r in c.ranks},
        "warnings": c.warnings,
    }


# -- command line --------------------------------------------------------------------------
def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", metavar="BASELINE", help=f"a run directory or its {FILE_NAME}")
    parser.add_argument("candidate", metavar="CANDIDATE", help=f"a run directory or its {FILE_NAME}")
    parser.add_argument("--metric", choices=METRICS, default="mean", help="what is compared per phase (default mean)")
    parser.add_argument("--fail-above", type=float, metavar="PCT", default=None,
                        help="exit 1 when a gated phase is slower by more than PCT percent and beyond noise (default: off)")
    parser.add_argument("--fail-above-memory", type=float, metavar="PCT", default=None,
                        help="exit 1 when the candidate's peak allocated memory is higher than the baseline's by "
                        "more than PCT percent (no noise band: the allocator's counters are deterministic in a steady "
                        "loop); exit 2 when a side has no memory data (default: off)")
    parser.add_argument("--fail-below-throughput", type=float, metavar="PCT", default=None,
                        help="exit 1 when the candidate's tokens/s (samples/s where a side counts no tokens) is lower "
                        "than the baseline's by more than PCT percent and beyond noise; exit 2 when a side has no "
                        "throughput (default: off)")
    parser.add_argument("--phase", action="append", metavar="NAME",
                        help="a phase to gate and give a verdict on (repeatable; default step)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run_compare(args: argparse.Namespace) -> int:
    for flag, pct in (("--fail-above", args.fail_above), ("--fail-above-memory", args.fail_above_memory),
                      ("--fail-below-throughput", args.fail_below_throughput)):
        if pct is not None and not (math.isfinite(pct) and pct >= 0):
            raise ReportError(f"{flag} must be a percentage >= 0, got {pct}")
    if not args.json:
        require("tabulate")
    base, cand = load_side(args.baseline), load_side(args.candidate)
    result = compare(base, cand, metric=args.metric, gated=args.phase or ["step"], fail_above=args.fail_above,
                     fail_above_memory=args.fail_above_memory, fail_below_throughput=args.fail_below_throughput)
    for w in result.warnings:
        print(f"phase-timer compare: warning: {w}", file=sys.stderr)
    print(json.dumps(to_json(result), indent=2) if args.json else format_comparison(result))
    return EXIT_SLOWER if result.failed or result.memory_failed or result.throughput_failed else 0
