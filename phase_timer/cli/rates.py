"""Throughput and MFU as both commands print them: the rates' names and labels, the run's lines, a rate's digits.

A run's rates and FLOPs come from its summary file (``throughput`` and, from version 6, ``flops``)
or, for a run without one, from its TensorBoard ``throughput/*`` windows
(:func:`~phase_timer.cli.read.tensorboard_throughput`).  The lines are the ones the run's own table
printed (:func:`phase_timer.measures.throughput.format_line`, :func:`phase_timer.measures.mfu.format_mfu`), rebuilt
from the file's numbers, so a report says what the run said.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phase_timer.outputs.run_summary import FILE_NAME

#: The rates a report or compare shows, in order, with their labels.
RATES = {"tokens_per_s": "tokens/s", "samples_per_s": "samples/s", "steps_per_s": "steps/s"}


def headline_rate(throughput: dict[str, Any] | None) -> str | None:
    """The rate a run is judged by: tokens/s where its batches hold tokens, else samples/s (None: no rates)."""
    if not throughput:
        return None
    return next((k for k in ("tokens_per_s", "samples_per_s") if throughput.get(k) is not None), None)


def throughput_line(throughput: dict[str, Any] | None) -> str | None:
    """``throughput: 36.9k tokens/s, 288.0 samples/s, 3.0 steps/s`` (and the job's), as the run printed it."""
    from phase_timer.measures.throughput import format_line

    if not throughput:
        return None
    rates = {k: throughput[k] for k in RATES if throughput.get(k) is not None}
    line = format_line(rates, throughput.get("job") or None)
    if line and throughput.get("source") == "tensorboard":
        why = "" if throughput.get("summary_skipped") else f"; no {FILE_NAME}"
        line += f" (from TensorBoard's throughput/* scalars, {throughput.get('windows')} windows{why})"
    return line


def format_rate(v: float) -> str:
    """A rate as the run's throughput line writes it (``36.9k``, ``587.2``); below one, three digits."""
    from phase_timer.measures.throughput import _si

    return _si(v) if v >= 1 else f"{v:.3g}"


def _flop(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}FLOP"
    return f"{x:.3g} FLOP"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _peak(peak: dict[str, Any]) -> Any:
    """The file's peak as :func:`~phase_timer.measures.mfu.format_mfu` takes it: a :class:`~phase_timer.measures.peaks.Peak` from the
    table, or the user's ``peak_tflops=`` (no device or precision named) as a number."""
    from phase_timer.measures.peaks import FP8, FP8_NOTE, Peak

    if not peak.get("device") or not peak.get("precision"):
        return float(peak["tflops"])
    return Peak(float(peak["tflops"]), peak["precision"], peak["device"], peak.get("source") or "",
                FP8_NOTE if peak["precision"] == FP8 else None)


def _step_flops(flops: dict[str, Any]) -> Any:
    """The file's mean FLOPs a step as a :class:`~phase_timer.measures.flops.StepFlops` (its recompute, its source)."""
    from phase_timer.measures.flops import BACKWARD, FORWARD, GIVEN, StepFlops

    per = flops.get("per_step") or {}
    source = flops.get("source") or GIVEN
    if per.get("forward") is not None and per.get("backward") is not None:
        return StepFlops({FORWARD: float(per["forward"]), BACKWARD: float(per["backward"])}, source)
    return StepFlops({}, source, given_total=float(per["hardware"])) if per.get("hardware") else None


def flops_line(flops: dict[str, Any] | None) -> str | None:
    """``FLOPs: 3.9 TFLOP a step (forward 1.3 TFLOP, backward 2.6 TFLOP; counted): 402.1 TFLOP/s``."""
    per = (flops or {}).get("per_step") or {}
    if not per.get("model"):
        return None
    split = ", ".join(f"{p} {_flop(per[p])}" for p in ("forward", "backward") if per.get(p) is not None)
    how = {"counted": "counted by FlopCounterMode", "given": "given: flops_per_step="}.get(flops.get("source"), "")
    inner = "; ".join(s for s in (split, how) if s)
    rate = flops.get("tflops_per_s")
    return (f"FLOPs: {_flop(per['model'])} a step{f' ({inner})' if inner else ''}"
            + (f": {rate:.1f} TFLOP/s" if rate is not None else ""))


def mfu_line(flops: dict[str, Any] | None) -> str | None:
    """The MFU line with its denominator (``MFU 41% of 989 TFLOP/s (bf16 dense, H100 SXM): forward 52%, ...``),
    or why there is none (the file's note)."""
    from phase_timer.measures.mfu import format_mfu

    if not flops:
        return None
    mfu, peak = flops.get("mfu") or {}, flops.get("peak")
    phases = {p: mfu[p] for p in ("forward", "backward") if mfu.get(p) is not None}
    if mfu.get("step") is not None and peak:
        return format_mfu(mfu["step"], phases, _peak(peak), _step_flops(flops))
    if mfu.get("step") is not None:  # TensorBoard alone: the ratio without its denominator
        split = "".join(f", {p} {_pct(r)}" for p, r in phases.items())
        return (f"MFU {_pct(mfu['step'])}{split} (from TensorBoard's throughput/mfu* scalars; the peak it is of is "
                f"in the run's {FILE_NAME})")
    note = flops.get("note")
    if not note:
        return None
    return note if note.startswith("MFU") else f"MFU: {note}"


def run_lines(throughput: dict[str, Any] | None, flops: dict[str, Any] | None) -> list[str]:
    """The throughput, FLOPs and MFU lines of one run (none of what it lacks)."""
    return [line for line in (throughput_line(throughput), flops_line(flops), mfu_line(flops)) if line]


def side_by_side_rows(throughputs: Sequence[dict | None], flopses: Sequence[dict | None]) -> list[tuple[str, ...]]:
    """The report's side-by-side rows: each rate and the MFU a run has (blank where it has none)."""
    rows = []
    for key, label in RATES.items():
        if any(t and t.get(key) is not None for t in throughputs):
            rows.append((label, *(format_rate(t[key]) if t and t.get(key) is not None else "" for t in throughputs)))
    mfus = [((f or {}).get("mfu") or {}).get("step") for f in flopses]
    if any(m is not None for m in mfus):
        rows.append(("MFU", *("" if m is None else _pct(m) for m in mfus)))
    return rows


def peak_label(flops: dict[str, Any] | None) -> str | None:
    """``989 TFLOP/s bf16 dense, H100 SXM`` (the MFU's denominator), None without a peak."""
    peak = (flops or {}).get("peak")
    if not peak:
        return None
    where = ", ".join(str(v) for v in (f"{peak.get('precision')} dense" if peak.get("precision") else None,
                                       peak.get("device")) if v)
    return f"{peak['tflops']:g} TFLOP/s" + (f" {where}" if where else " (peak_tflops=)")
