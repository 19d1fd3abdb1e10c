"""MFU: a step's FLOPs over what the device could have done in its time at its dense peak.

``MFU = FLOPs / (seconds * peak)``: for the step over ``period`` (the headline, as torchtitan
defines it: the model's FLOPs, recompute left out, over the whole time a step takes), and per
phase over that phase's GPU time (the FLOPs that phase ran, recompute included: how busy the
device's matmul units were while it ran).  The optimizer's FLOPs are ~0 and it is memory-bound:
it is time in the headline's denominator, never a ratio of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from phase_timer.measures.flops import BACKWARD, FORWARD, GIVEN, StepFlops
from phase_timer.measures.peaks import FP32, TF32, Peak

#: Phases that get their own MFU.
PHASES = (FORWARD, BACKWARD)
#: Below this the headline is "low" for a GPU-bound run: PaLM reported 46% MFU, and well-tuned
#: large transformers reach 35-55% in bf16 on A100/H100 (docs/flops.md).
LOW = 0.30
#: The optimizer's share of the step from which a fused optimizer is worth saying.
OPTIMIZER_SHARE = 0.10
#: A phase this far below the best phase's MFU, or under LOW, is "far from the peak".
FAR = 0.5


def mfu(flops: float | None, ms: float | None, peak: Peak | float | None) -> float | None:
    """FLOPs done in ``ms`` milliseconds over the peak's FLOPs in that time (0.41 = 41%); None without
    FLOPs, a time or a peak (``peak``: a :class:`Peak` or TFLOP/s)."""
    tflops = peak.tflops if isinstance(peak, Peak) else peak
    if flops is None or ms is None or tflops is None or ms <= 0 or tflops <= 0 or flops <= 0:
        return None
    return flops / (ms * 1e-3 * tflops * 1e12)


def step_mfu(flops: StepFlops, period_ms: float, phase_ms: Mapping[str, float],
             peak: Peak | float) -> tuple[float | None, dict[str, float]]:
    """The headline (model FLOPs over the mean ``period``) and each phase's MFU (its FLOPs over its mean GPU
    time), for steps of one count.  A phase without FLOPs or time gets none."""
    head = mfu(flops.model_total, period_ms, peak)
    phases = {p: r for p in PHASES if (r := mfu(flops.phases.get(p), phase_ms.get(p), peak)) is not None}
    return head, phases


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _tflops(peak: Peak | float) -> str:
    value = peak.tflops if isinstance(peak, Peak) else peak
    return f"{value:.4g}" if value < 100 else f"{value:.0f}"


def format_mfu(head: float | None, phases: Mapping[str, float], peak: Peak | float,
               flops: StepFlops | None = None) -> str:
    """The table's MFU line, the denominator beside the ratio:
    ``MFU 41% of 989 TFLOP/s (bf16 dense, H100 SXM): forward 52%, backward 47%``."""
    where = (f"{peak.precision} dense, {peak.device}" if isinstance(peak, Peak) else "peak_tflops=")
    line = f"MFU {_pct(head) if head is not None else 'n/a'} of {_tflops(peak)} TFLOP/s ({where})"
    if phases:
        line += ": " + ", ".join(f"{p} {_pct(r)}" for p, r in phases.items())
    notes = []
    if flops is not None and flops.source == GIVEN:
        notes.append("FLOPs given (flops_per_step=)")
    if flops is not None and flops.recompute > 0:
        notes.append(f"backward's count has {flops.recompute / flops.backward:.0%} recompute (activation "
                     "checkpointing, attention's backward): in its ratio, not in the headline")
    if isinstance(peak, Peak) and peak.note:
        notes.append(peak.note)
    return line + "".join(f"; {n}" for n in notes)


def format_no_peak(device_name: str | None, precision: str | None) -> str:
    """The line for a device or precision the peak table lacks."""
    return f'MFU: no peak known for "{device_name}" ({precision or "unknown precision"}): pass peak_tflops='


def format_no_flops(why: str | None = None) -> str:
    """The line for a run with a peak but no FLOPs."""
    return f"MFU: no FLOPs {'(' + why + ')' if why else 'counted'}: pass flops_per_step="


def mfu_advice(head: float | None, phases: Mapping[str, float], *, gpu_bound: bool,
               precision: str | None, optimizer_share: float | None = None) -> list[str]:
    """The verdict's MFU lines.  Over 100%: the count or the peak is wrong (nothing else is said).  A
    GPU-bound run under ``LOW``: which phase is far from the peak and what usually lifts it.
    ``precision`` is the peak's key (``bf16``, ``tf32``, ``fp32`` ...); ``optimizer_share``: its part of the step."""
    over = {p: r for p, r in {"step": head, **phases}.items() if r is not None and r > 1.0}
    if over:
        said = ", ".join(f"{p} {_pct(r)}" for p, r in over.items())
        return [f"MFU over 100% ({said}) cannot be: the FLOP count or the peak is wrong (a peak for another device "
                "or precision, or flops_per_step= too high); pass peak_tflops= or flops_per_step="]
    if not gpu_bound or head is None or head >= LOW:
        return []
    tips = [f"MFU is {_pct(head)} though the GPU is the bottleneck: its time goes to work other than dense matmuls"]
    best = max(phases.values(), default=0.0)
    far = [p for p, r in phases.items() if r < LOW or r < FAR * best]
    for p in far:
        tips.append(f"{p} runs at {_pct(phases[p])} of the peak: far from it")
    if precision in (FP32, TF32):
        lifts = "bf16 autocast (precision='bf16-mixed')"
        if precision == FP32:
            lifts += " or TF32 (torch.set_float32_matmul_precision('high'))"
        tips.append(f"the run's matmuls are in {precision}: {lifts} raises the peak they can reach")
    tips.append("larger matmuls (a larger batch or hidden size, dimensions multiples of 64) keep the tensor cores busy")
    tips.append("torch.compile fuses the element-wise work between the matmuls (its time counts, its FLOPs do not)")
    if optimizer_share is None or optimizer_share >= OPTIMIZER_SHARE:
        said = f" is {_pct(optimizer_share)} of the step and" if optimizer_share is not None else ""
        tips.append(f"the optimizer{said} does no matmul: a fused optimizer (fused=True) shortens it")
    return tips
