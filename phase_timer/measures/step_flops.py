"""A run's FLOPs and MFU: which step is counted, every timed step's FLOPs carried with it, the peak.

Every door hands each batch to ``Boundaries.count_batch`` (``run/boundaries.py``).  At a step's
first batch the boundaries read its signature (``phase_timer.signature``: shapes only, on the host) and

- a signature already counted (or ``flops_per_step=``): the step carries its FLOPs as three host
  values (``flops``, ``flops_forward``, ``flops_backward``), summed over the window's steps
  (:func:`split_flops`), so a window's FLOPs are exactly its timed steps';
- a new signature: that step is counted (``FlopCounterMode``, ``flops.FlopCounter``) and goes
  untimed -- a warm-up step where one is left that is not the sync census's, else the step is
  dropped from the record as a warm-up step is (its close still ends the next step's ``period``).

MFU = FLOPs / (time x the device's dense peak) (``mfu.py``): the step's over ``period``, each
phase's over its own GPU time, per window (``throughput/mfu*``) and over the run (the table's MFU
line, the summary's ``flops`` block, the verdict).  The peak is the table's (``peaks.py``) for the
device and the dtype most counted FLOPs ran in, or ``peak_tflops=``; none is ever guessed.

:class:`FlopPlan` is the measure (:class:`phase_timer.measure.Measure`): the boundaries count with it,
and the core hands it each window and the run's end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from phase_timer._env import warn
from phase_timer.measure import Measure
from phase_timer.measures.flops import BACKWARD, COUNTED, FORWARD, GIVEN, FlopCounter, StepFlops
from phase_timer.measures.mfu import format_mfu, format_no_flops, format_no_peak, mfu_advice, step_mfu
from phase_timer.measures.peaks import BF16, FP8, FP16, FP32, TF32, Peak, peak_tflops, precision_key, tf32_allowed

#: The host values a step carries for its FLOPs (reserved names: no phase may take them).
FLOPS, FLOPS_FORWARD, FLOPS_BACKWARD = "flops", "flops_forward", "flops_backward"
CARRIED = (FLOPS, FLOPS_FORWARD, FLOPS_BACKWARD)
#: What :func:`split_flops` sums with them: the steps that carried FLOPs, their period and phases.
FLOP_STEPS, FLOP_PERIOD_MS = "flop_steps", "flop_period_ms"
PHASE_MS = {FORWARD: "flop_forward_ms", BACKWARD: "flop_backward_ms"}
PREFIX = "throughput"
log = logging.getLogger(__name__)


def dtype_key(dtype: Any, *, tf32: bool) -> str | None:
    """The peak table's key for the dtype a matmul's inputs had (None: one it has no peak for)."""
    if dtype == torch.bfloat16:
        return BF16
    if dtype == torch.float16:
        return FP16
    if dtype == torch.float32:
        return TF32 if tf32 else FP32
    if "float8" in str(dtype):
        return FP8
    return None


def split_flops(columns: dict[str, list[float]]) -> dict[str, float]:
    """Take the FLOPs out of a window's columns: each of :data:`CARRIED` summed over the window's steps when every
    one carries it, with those steps' summed ``period`` (``flop_period_ms``), their count (``flop_steps``) and
    forward's and backward's summed time (``flop_forward_ms``, ``flop_backward_ms``), the MFUs' denominators."""
    out: dict[str, float] = {}
    period = columns.get("period")
    n = len(period) if period else 0
    for name in CARRIED:
        values = columns.pop(name, None)
        if values and len(values) == n:  # carried on every step of the window (an uncounted shape: none)
            out[name] = float(sum(values))
    if n and FLOPS in out:
        out[FLOP_PERIOD_MS] = float(sum(period))
        out[FLOP_STEPS] = float(n)
        for phase, key in PHASE_MS.items():
            out[key] = float(sum(columns.get(phase) or ()))
    return out


class FlopPlan(Measure):
    """One run's FLOPs: the counter, the step counted last, and the peak MFU is read against; the FLOPs/MFU measure.

    Args:
        owner: the timer's name, for messages.
        given: ``flops_per_step=`` checked (``flops.check_flops_arg``), or None to count.
        peak_tflops: ``peak_tflops=``, or None for the table's.
        device_name: the device as torch names it (``NVIDIA H100 80GB HBM3``); None on the host.
        compute_units: its multiprocessor count (tells an MI250X's GCD from an MI250's).
    """

    key = "flops"

    def __init__(self, owner: str, *, given: StepFlops | None, peak_tflops: float | None,
                 device_name: str | None, compute_units: int | None = None) -> None:
        self.counter = FlopCounter(owner=owner, given=given)
        self.peak_arg = peak_tflops
        self.device_name = device_name
        self.compute_units = compute_units
        #: ``Boundaries.begun`` at the last step whose first batch was seen (a step's other batches: nothing).
        self.begun = -1
        #: What a step of each signature adds: ((name, FLOPs), ...), made once per count.
        self.carried: dict[Any, tuple[tuple[str, float], ...]] = {}
        #: Whether a count may start now (a door that can tell the training loop's thread from another: a count
        #: begun on a prefetching thread could never leave its dispatch mode from the loop's); None: always.
        self.may_count: Callable[[], bool] | None = None
        #: What every step adds when ``flops_per_step=`` was given (None: counted per shape).
        self.given_carried = self.carry(given) if given is not None else None
        self._peak: Peak | float | None = None
        self._peak_known = False
        #: What the door knows of the run (the core's ``context``: its precision names a peak).
        self.context: Mapping[str, Any] = {}
        #: The run's summed FLOPs, their steps, period and phases (:func:`split_flops`, window by window).
        self.counts: dict[str, float] = {}
        self._window: dict[str, float] = {}  # the last window's: this rank's report carries them
        #: The summary file's ``flops`` block, made at the run's end (None: not yet, or it failed).
        self.block: dict[str, Any] | None = None
        #: The batches' shapes could not be read (``Boundaries.count_batch``): no FLOPs nor MFU from then on.
        self.dropped = False

    @staticmethod
    def carry(flops: StepFlops) -> tuple[tuple[str, float], ...]:
        """The host values a step with these FLOPs adds: everything the device ran, and forward's and backward's."""
        out = [(FLOPS, flops.hardware_total)]
        if flops.forward is not None and flops.backward is not None:
            out += [(FLOPS_FORWARD, flops.forward), (FLOPS_BACKWARD, flops.backward)]
        return tuple(out)

    # -- the peak ---------------------------------------------------------------------
    def precision(self, context: Mapping[str, Any]) -> str | None:
        """The peak table's key for the run: the dtype most counted FLOPs ran in, else the run's precision."""
        tf32 = tf32_allowed()
        dtypes: dict[Any, float] = {}
        for count in self.counter.counts.values():
            for dtype, n in count.dtypes.items():
                dtypes[dtype] = dtypes.get(dtype, 0.0) + n
        if dtypes:
            return dtype_key(max(dtypes, key=dtypes.__getitem__), tf32=tf32)
        named = context.get("precision")
        if named is None and context.get("autocast") is not None:
            named = dtype_key(context["autocast"], tf32=tf32)
        return precision_key(named, tf32=tf32)

    def peak(self, context: Mapping[str, Any]) -> Peak | float | None:
        """The device's dense peak for the run (``peak_tflops=``, or the table's), None when not known.
        Looked up once the run's precision is known (after a count, or once the door has said it)."""
        if self.peak_arg is not None:
            return self.peak_arg
        if self._peak_known:
            return self._peak
        key = self.precision(context)
        if key is None or not self.device_name:
            return None
        self._peak = peak_tflops(self.device_name, key, compute_units=self.compute_units)
        self._peak_known = bool(self.counter.counts) or "precision" in context
        return self._peak

    # -- windows and the run ---------------------------------------------------------------
    def scalars(self, counts: Mapping[str, float], context: Mapping[str, Any]) -> dict[str, float]:
        """A window's ``throughput/tflops_per_s`` and ``throughput/mfu[_forward|_backward]`` (fractions)."""
        if FLOPS not in counts:
            return {}
        ms = counts[FLOP_PERIOD_MS]
        out = {f"{PREFIX}/tflops_per_s": _summed(counts).model_total / (ms * 1e-3) / 1e12} if ms > 0 else {}
        peak = self.peak(context)
        if peak is not None:
            head, phases = _mfus(counts, peak)
            if head is not None:
                out[f"{PREFIX}/mfu"] = head
            out.update({f"{PREFIX}/mfu_{p}": r for p, r in phases.items()})
        return out

    def run(self, counts: Mapping[str, float], context: Mapping[str, Any]) -> dict[str, Any] | None:
        """The summary file's ``flops`` block from the run's summed counts (None: no FLOPs, none asked for)."""
        steps = counts.get(FLOP_STEPS, 0.0)
        peak = self.peak(context)
        if not steps or FLOPS not in counts:
            counter = self.counter
            why = counter.failed or (
                f"more than {counter.max_shapes} batch shapes: a window holding a step of an uncounted one has no "
                "FLOPs; pad to a few fixed shapes" if counter.uncounted else
                "no timed step had a counted shape" if counter.counts or counter.given else "no step was counted")
            return {"source": None, "per_step": None, "tflops_per_s": None, "peak": _peak_dict(peak),
                    "mfu": None, "note": format_no_flops(why)}
        per_step = {"forward": counts.get(FLOPS_FORWARD, 0.0) / steps if FLOPS_FORWARD in counts else None,
                    "backward": counts.get(FLOPS_BACKWARD, 0.0) / steps if FLOPS_BACKWARD in counts else None,
                    "hardware": counts[FLOPS] / steps, "model": _summed(counts).model_total / steps}
        ms = counts.get(FLOP_PERIOD_MS, 0.0)
        out: dict[str, Any] = {
            "source": GIVEN if self.counter.given is not None else COUNTED, "per_step": per_step,
            "tflops_per_s": _summed(counts).model_total / (ms * 1e-3) / 1e12 if ms > 0 else None, "peak": _peak_dict(peak),
            "mfu": None, "note": None,
        }
        if peak is None:
            out["note"] = format_no_peak(self.device_name, self.precision(context))
        else:
            head, phases = _mfus(counts, peak)
            out["mfu"] = {"step": head, "forward": phases.get(FORWARD), "backward": phases.get(BACKWARD)}
        return out

    def mfu_line(self, block: Mapping[str, Any] | None) -> str | None:
        """The table's MFU line, from the summary's ``flops`` block."""
        if block is None:
            return None
        if block["mfu"] is None:
            done = block.get("tflops_per_s")
            return block["note"] + (f" (the run did {done:.3g} TFLOP/s)" if done else "")
        peak = self.peak_arg if self.peak_arg is not None else self._peak
        per = block["per_step"]
        phases = {p: block["mfu"][p] for p in (FORWARD, BACKWARD) if block["mfu"].get(p) is not None}
        flops = StepFlops({} if per["forward"] is None else {FORWARD: per["forward"], BACKWARD: per["backward"]},
                          block["source"], given_total=None if per["forward"] is not None else per["hardware"])
        return format_mfu(block["mfu"]["step"], phases, peak, flops)

    def advice(self, block: Mapping[str, Any] | None, *, optimizer_share: float | None,
               gpu_bound: bool = True) -> list[str]:
        """The verdict's MFU lines (``mfu.mfu_advice``)."""
        if not block or not block.get("mfu"):
            return []
        m = block["mfu"]
        phases = {p: m[p] for p in (FORWARD, BACKWARD) if m.get(p) is not None}
        precision = (block.get("peak") or {}).get("precision")
        return mfu_advice(m["step"], phases, gpu_bound=gpu_bound, precision=precision,
                          optimizer_share=optimizer_share)


    # -- the measure -------------------------------------------------------------------------
    def window(self, columns: dict[str, list[float]]) -> dict[str, float]:
        """The window's FLOPs out of its columns (no phases); its ``throughput/tflops_per_s`` and MFUs."""
        counts = self._window = split_flops(columns)
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + v
        return self.scalars(counts, self.context) if not self.dropped else {}

    def step(self, ms: dict[str, float]) -> None:
        for name in CARRIED:
            ms.pop(name, None)  # FLOPs, not phases: a step's MFU is its window's

    def report(self) -> dict[str, float]:
        return self._window

    def end(self, totals: Any) -> list[str]:
        """The summary's ``flops`` block from the run's counts; the verdict's MFU lines.  Never raises: MFU is an
        extra, the verdict and the files go on without it."""
        self.block = None
        if self.dropped:
            return []
        try:
            self.block = self.run(self.counts, self.context)
            return self.advice(self.block, optimizer_share=totals.share("optimizer", "step"))
        except Exception as err:  # noqa: BLE001 - MFU is an extra
            warn(log, f"phase-timer: could not compute MFU ({type(err).__name__}: {err})")
            return []

    def line(self) -> str | None:
        return self.mfu_line(self.block) if not self.dropped else None

    def summary(self) -> dict[str, Any] | None:
        return self.block if not self.dropped else None


class MfuNote(Measure):
    """Where no FLOPs are counted though MFU was asked for (the host clock with no peak): the table says how to get it."""

    def __init__(self, note: str) -> None:
        self.note = note

    def line(self) -> str | None:
        return self.note


def _summed(counts: Mapping[str, float]) -> StepFlops:
    """A window's or the run's summed FLOPs as one :class:`StepFlops`: its recompute rule gives the model's FLOPs.
    What ran outside forward and backward (the optimizer's, ~0) is kept as ``other``, so that the total is all run."""
    if FLOPS_FORWARD not in counts or FLOPS_BACKWARD not in counts:  # given as one total
        return StepFlops({}, GIVEN, given_total=counts[FLOPS])
    fwd, bwd = counts[FLOPS_FORWARD], counts[FLOPS_BACKWARD]
    return StepFlops({FORWARD: fwd, BACKWARD: bwd, "other": counts[FLOPS] - fwd - bwd}, COUNTED)


def _mfus(counts: Mapping[str, float], peak: Peak | float) -> tuple[float | None, dict[str, float]]:
    """The step's MFU and forward's and backward's (``mfu.step_mfu``) of summed counts."""
    phase_ms = {phase: counts.get(key) for phase, key in PHASE_MS.items()}
    return step_mfu(_summed(counts), counts.get(FLOP_PERIOD_MS), phase_ms, peak)


def _peak_dict(peak: Peak | float | None) -> dict[str, Any] | None:
    if peak is None:
        return None
    if isinstance(peak, Peak):
        return {"tflops": peak.tflops, "precision": peak.precision, "device": peak.device, "source": peak.source}
    return {"tflops": float(peak), "precision": None, "device": None, "source": "peak_tflops="}
