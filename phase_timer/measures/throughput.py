"""Throughput: samples, tokens and steps a second, from ``period`` (the real time per step), without a sync.

A step's samples and tokens are read from its batches' *shapes* on the host when each batch is
handed over (a tensor's leading dimension; for token batches the input ids' ``numel``, padding
included), never from values on the device.  The door adds them to the step's record as two
host values (``samples``, ``tokens``: the engine sums a step's micro-batches), so that they come
back with the step's ``period`` in the same window, for exactly the steps that were timed.
:class:`RunThroughput`, the measure (:class:`phase_timer.measure.Measure`), takes them out of the
window's columns (:func:`split_counts`): they are counts, not phases.  The boundaries count each
batch with its :class:`BatchCounter` (``RunThroughput.counter``).

Rates are totals over totals: a window's samples over its steps' summed ``period``; the run's
the same over every timed step; the job's (under torch.distributed) the sum of the ranks' rates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import logging

import torch

from phase_timer._env import warn
from phase_timer.config import check_count  # noqa: F401 - re-exported: the argument's rule
from phase_timer.measure import Measure

#: The host values a step carries besides its phases (reserved: no phase may take these names).
SAMPLES, TOKENS = "samples", "tokens"
COUNTS = (SAMPLES, TOKENS)
PREFIX = "throughput"
#: The table's line where no step's batch could be counted (said once, at the end).
NOT_COUNTED = ("throughput: not counted: no batch's size could be read (the batches, or the model's inputs without "
               "a loader, hold no tensor phase-timer can read a batch size from); pass samples_per_batch= and "
               "tokens_per_batch= (a number, or a function of the batch)")
log = logging.getLogger(__name__)
#: Keys that name a mapping batch's token ids (🤗 models, most LM data pipelines).
_TOKEN_KEYS = ("input_ids", "tokens", "token_ids")

Count = int | Callable[[Any], int] | None


#: Token ids are integers (not a bool mask, not floats): the dtypes a tensor of ids may have.
_ID_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The batch's leading tensor: itself, a mapping's token ids or first value, a sequence's first item."""
    for _ in range(4):  # nested at most a few levels: ((x, y), meta), {"inputs": {...}}
        kind = type(batch)  # the usual kinds first, by identity: a door calls this every batch
        if kind is tuple or kind is list:
            if not batch:
                return None
            batch = batch[0]
        elif kind is dict or isinstance(batch, Mapping):
            key = next((k for k in _TOKEN_KEYS if k in batch), None)
            batch = batch[key] if key is not None else next(iter(batch.values()), None)
        elif isinstance(batch, torch.Tensor):
            return batch
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return None
    return batch if isinstance(batch, torch.Tensor) else None


def shape_counts(batch: Any) -> tuple[int | None, int | None]:
    """(samples, tokens) of one batch from its shapes: the leading tensor's first dimension; its ``numel``
    when it holds token ids (an integer tensor of two or more dimensions), else no tokens."""
    t = first_tensor(batch)
    if t is None:
        return None, None
    shape = t.shape
    if not shape:
        return None, None
    return shape[0], (t.numel() if len(shape) >= 2 and t.dtype in _ID_DTYPES else None)


@dataclass(frozen=True)
class BatchCounter:
    """How a door counts a batch: from its shapes, or as the user says (a count, or a function of the batch)."""

    samples: Count = None
    tokens: Count = None
    #: A count failed once: no more counting (set by ``add``).
    broken: bool = False

    def count(self, batch: Any) -> tuple[int | None, int | None]:
        samples, tokens = (None, None) if self.samples is not None and self.tokens is not None else shape_counts(batch)
        return _given(self.samples, batch, samples), _given(self.tokens, batch, tokens)

    def add(self, add_host: Callable[[str, float], None], batch: Any) -> None:
        """Add one batch's counts to the open step (``core.add_host``: a no-op when no step is recorded).

        Never raises into training: a count that fails (a user's function, an odd batch) warns once, and
        batches are not counted from then on (no rate rather than a wrong one)."""
        if self.broken:
            return
        try:
            samples, tokens = self.count(batch)
            if samples is not None:
                add_host(SAMPLES, float(samples))
            if tokens:
                add_host(TOKENS, float(tokens))
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            object.__setattr__(self, "broken", True)
            warn(log, f"phase-timer: a batch could not be counted for throughput ({type(err).__name__}: {err}); "
                      "throughput is not reported from here on", 3)


def _given(how: Count, batch: Any, default: int | None) -> int | None:
    if how is None:
        return default
    return int(how(batch)) if callable(how) else how


def split_counts(columns: dict[str, list[float]], run: RunThroughput | None = None) -> dict[str, float]:
    """Take the counts out of a window's columns: ``{samples, tokens}`` summed over the window's steps that
    carry them, with ``period_ms`` summed over the same steps (every timed step has a period).

    ``run``: the run's counts, told whether every step of this window had the same count (once a window)."""
    out: dict[str, float] = {}
    period = columns.get("period")
    n = len(period) if period else 0
    for name in COUNTS:
        values = columns.pop(name, None)
        # Counted on every step of the window (a batch whose shapes say nothing leaves a step out: then none).
        if values and len(values) == n:
            out[name] = float(sum(values))
            if run is not None:
                run.note_per_step(name, min(values), max(values))
    if n and out:
        out["period_ms"] = float(sum(period))
        out["steps"] = float(n)
    return out


def rates(counts: Mapping[str, float]) -> dict[str, float]:
    """``{samples_per_s, tokens_per_s, steps_per_s}`` of summed counts (those known)."""
    seconds = counts.get("period_ms", 0.0) / 1e3
    if seconds <= 0:
        return {}
    out = {f"{name}_per_s": counts[name] / seconds for name in (*COUNTS, "steps") if name in counts}
    return out


def job_rates(by_rank: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """The job's rates: each rank's (its counts over its own period), summed over the ranks."""
    out: dict[str, float] = {}
    for counts in by_rank.values():
        for k, v in rates(counts).items():
            if k != "steps_per_s":  # every rank runs the same steps: the job's steps/s is a rank's
                out[k] = out.get(k, 0.0) + v
    return out


def scalars(counts: Mapping[str, float]) -> dict[str, float]:
    """A window's ``throughput/<name>_per_s`` values."""
    return {f"{PREFIX}/{k}": v for k, v in rates(counts).items()}


#: ``RunThroughput.per_step``'s mark of a count that differed from step to step.
VARIED = -1.0


class RunThroughput(Measure):
    """The run's counts over every timed step, window by window: the throughput measure.

    ``per_step``: each count's value when every counted step had the same (``VARIED`` once two differed).
    ``phase-timer compare`` needs it: with a constant count a window's rate is that count over its mean
    ``period``, so a rate's window-to-window noise comes from the period's, which the summary file keeps.

    Args:
        counter: how the boundaries count a batch (None: nothing counts one).
        ranks: the rank exchange (``distributed.ranks.RankExchange``; None: one process): rank zero's job rates.
    """

    key = "throughput"

    def __init__(self, counter: BatchCounter | None = None, ranks: Any = None) -> None:
        self.counter = counter
        self.ranks = ranks
        self.counts: dict[str, float] = {}
        self.per_step: dict[str, float] = {}
        self._window: dict[str, float] = {}  # the last window's counts: this rank's report carries them
        self._timed = False  # a window was resolved (a step timed)

    def note_per_step(self, name: str, lowest: float, highest: float) -> None:
        """One window's smallest and largest count of ``name`` a step."""
        seen = self.per_step.get(name)
        same = lowest == highest and seen in (None, lowest)
        self.per_step[name] = lowest if same else VARIED

    def add(self, counts: Mapping[str, float]) -> None:
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + v

    def rates(self) -> dict[str, float]:
        return rates(self.counts)

    def as_dict(self) -> dict[str, Any] | None:
        """The run's counts and rates (None: nothing counted)."""
        if SAMPLES not in self.counts:
            return None
        per_step = {name: (v if v != VARIED else None) for name in COUNTS if (v := self.per_step.get(name)) is not None}
        return {"samples": self.counts.get("samples"), "tokens": self.counts.get("tokens"),
                "steps": self.counts.get("steps"), **self.rates(),
                "per_step": {name: per_step.get(name) for name in COUNTS}}

    def job_rates(self) -> dict[str, float] | None:
        """The job's rates under torch.distributed (rank zero): each rank's over its whole run, summed."""
        totals = self.ranks.totals if self.ranks is not None else None
        # a rank's pauses travel with its counts, with no rate of their own
        counted = {r: c for r, c in totals.counts.items() if "period_ms" in c} if totals is not None else {}
        return job_rates(counted) if counted else None

    # -- the measure -------------------------------------------------------------------------
    def window(self, columns: dict[str, list[float]]) -> dict[str, float]:
        """The window's counts out of its columns (counts, not phases); its ``throughput/*_per_s``."""
        counts = self._window = split_counts(columns, self)
        self._timed = True
        if counts:
            self.add(counts)
        return scalars(counts)

    def step(self, ms: dict[str, float]) -> None:
        for name in COUNTS:
            ms.pop(name, None)  # counts, not phases: a step's rates are its window's

    def report(self) -> dict[str, float]:
        return self._window

    def job(self, window: Any) -> dict[str, float]:
        """The job's rates over a window of the ranks' (``throughput/job_*``)."""
        return {f"{PREFIX}/job_{k}": v for k, v in window.job.items()}

    def line(self) -> str | None:
        """``throughput: ...`` (and the job's), or why nothing was counted (None: nothing timed, nothing counts)."""
        line = format_line(self.rates(), self.job_rates())
        if line is None and self._timed and self.counter is not None:
            return NOT_COUNTED
        return line

    def summary(self) -> dict[str, Any] | None:
        """This rank's rates (under torch.distributed, the job's beside them; None: nothing counted)."""
        out = self.as_dict()
        if out is not None:
            out["job"] = self.job_rates()
        return out


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.1f}"


def format_line(run: Mapping[str, float], job: Mapping[str, float] | None = None) -> str | None:
    """``throughput: 36.9k tokens/s, 288.0 samples/s, 3.0 steps/s`` (and the job's, across ranks)."""
    if not run:
        return None
    parts = [f"{_si(run[k])} {label}" for k, label in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"),
                                                       ("steps_per_s", "steps/s")) if k in run]
    line = "throughput: " + ", ".join(parts)
    if job:
        line += "; the job (every rank): " + ", ".join(
            f"{_si(job[k])} {label}" for k, label in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))
            if k in job)
    return line
