"""The memory rules: pressure, creep, fragmentation, one rank holding more, headroom."""

from __future__ import annotations

import os
import statistics
from typing import Any

from phase_timer.diagnosis.finding import (
    CREEP_HIGH_STEPS, CREEP_MIN_MB, CREEP_POINTS, CREEP_RISING, Diagnosis, FILL_SHARE, FRAG_MIN_MB, FRAG_RATIO,
    HEADROOM_SHARE, IMBALANCE_MIN_MB, IMBALANCE_SHARE, PRESSURE_HIGH, PRESSURE_SHARE, _pct,
)
from phase_timer.phases import BEFORE, BEFORE_NOTE


def memory_findings(mem: dict[str, Any] | None) -> list[Diagnosis]:
    """The memory rules, in order: pressure, creep, fragmentation, rank imbalance, headroom (none off CUDA)."""
    if not mem or not mem.get("samples"):
        return []
    worst = _fullest_rank(mem)
    found = [_pressure(worst), _creep(mem), _fragmentation(mem), _rank_imbalance(mem)]
    if found[0] is None:
        found.append(_headroom(worst))
    return [f for f in found if f is not None]


def _fullest_rank(mem: dict[str, Any]) -> dict[str, Any]:
    """Distributed: rank zero's memory with the peaks, device and retries of the rank whose reserved peak fills
    the largest share of its device (the job fits only if that rank does); alone: the memory as it is."""
    ranks = mem.get("ranks") or {}
    shares = {r: v["peak_reserved_mb"] / v["device_total_mb"] for r, v in ranks.items()
              if v.get("device_total_mb") and v.get("peak_reserved_mb") is not None}
    if not shares:
        return mem
    r = max(shares, key=lambda k: (shares[k], -int(k)))
    v = ranks[r]
    retries = sum(int(x.get("alloc_retries") or 0) for x in ranks.values())
    return {**mem, "peak_allocated_mb": v["peak_allocated_mb"], "peak_reserved_mb": v["peak_reserved_mb"],
            "device_total_mb": v["device_total_mb"], "alloc_retries": retries, "rank": int(r)}


def _gb(mb: float) -> str:
    return f"{mb / 1024:.2f} GiB" if abs(mb) >= 1024 else f"{mb:.0f} MiB"  # binary, as the allocator says them


def _peak_where(mem: dict[str, Any]) -> str:
    phase, step = mem.get("peak_phase"), mem.get("peak_step")
    if phase == BEFORE:
        return f" ({BEFORE_NOTE})"
    return f" (set in {phase}" + (f", step {step})" if step is not None else ")") if phase else ""


def _activations(mem: dict[str, Any]) -> float | None:
    act = (mem.get("allocated_mb") or {}).get("activations")
    return act["mean"] if act else None


def _pressure(mem: dict[str, Any]) -> Diagnosis | None:
    total, reserved, retries = mem.get("device_total_mb"), mem.get("peak_reserved_mb"), mem.get("alloc_retries") or 0
    share = reserved / total if total and reserved is not None else None
    if not retries and (share is None or share < PRESSURE_SHARE):
        return None
    peak = mem.get("peak_allocated_mb") or 0.0
    on = f" on rank {mem['rank']}" if "rank" in mem else ""
    why = (f"the peak reserved{on} is {_gb(reserved or 0.0)}" + (f", {_pct(share)} of the device's {_gb(total)}" if share else "")
           + f"; peak allocated {_gb(peak)}{_peak_where(mem)}")
    if retries:
        why += (f"; the allocator ran out {retries} time(s) and freed its cache to retry (each a device-wide "
                "sync, and a step away from out-of-memory)")
    tips = []
    act = _activations(mem)
    if act is not None and peak > 0:
        tips.append(f"activations are {_gb(act)} ({_pct(act / peak)} of the peak): activation checkpointing, or a "
                    "smaller micro-batch with gradient accumulation")
    tips += ["bf16 autocast halves activations; a fused or 8-bit optimizer shrinks its state",
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, if reserved runs well above allocated"]
    ev = {"peak_reserved_mb": reserved, "peak_allocated_mb": peak, "device_total_mb": total, "share_of_device": share,
          "alloc_retries": retries, "peak_phase": mem.get("peak_phase"), "activations_mb": act}
    severity = "high" if retries or (share is not None and share >= PRESSURE_HIGH) else "medium"
    return Diagnosis("MEMORY_PRESSURE", severity, why, tuple(tips), ev)


def _creep(mem: dict[str, Any]) -> Diagnosis | None:
    c = mem.get("creep")
    if not c or c["points"] < CREEP_POINTS or c["rise_mb"] < CREEP_MIN_MB or c["rising_share"] < CREEP_RISING \
            or c["mb_per_step"] <= 0:
        return None
    rate = c["mb_per_step"]
    total, peak = mem.get("device_total_mb"), mem.get("peak_allocated_mb")
    left = (total - peak) / rate if total and peak is not None else None
    why = (f"allocated memory at the step's begin rises {rate:.2f} MiB a step ({_gb(c['rise_mb'])} from step "
           f"{c['from_step']} to {c['to_step']}, {c['points']} samples)")
    if left is not None:
        why += f": at that rate the device is full in about {left:,.0f} more steps"
    tips = ("a tensor kept across steps: a loss appended to a list without .item() or .detach() (it keeps its "
            "graph), metrics accumulated on the device, a cache that grows (per-batch-shape kernels, a dict of tensors)",
            "torch.cuda.memory._record_memory_history() then _dump_snapshot() on two steps shows what was allocated "
            "and not freed, and where")
    ev = {**c, "steps_to_full": left, "device_total_mb": total, "peak_allocated_mb": peak}
    return Diagnosis("MEMORY_CREEP", "high" if left is not None and left < CREEP_HIGH_STEPS else "medium", why, tips, ev)


def _expandable() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _fragmentation(mem: dict[str, Any]) -> Diagnosis | None:
    reserved, peak = mem.get("peak_reserved_mb"), mem.get("peak_allocated_mb")
    if not reserved or not peak or reserved < FRAG_RATIO * peak or reserved - peak < FRAG_MIN_MB:
        return None
    total = mem.get("device_total_mb")
    why = (f"the allocator reserved {_gb(reserved)} at its peak for {_gb(peak)} allocated at most: "
           f"{_gb(reserved - peak)} ({reserved / peak:.2f}x) held in its cache that no tensor uses")
    tips = ["blocks of many sizes split the cache (varying sequence lengths or batch shapes): pad to a few fixed shapes"]
    expandable = _expandable()
    if not expandable:
        tips.insert(0, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow instead of splitting")
    ev = {"peak_reserved_mb": reserved, "peak_allocated_mb": peak, "ratio": reserved / peak, "device_total_mb": total,
          "expandable_segments": expandable}
    severity = "medium" if total and reserved >= 0.8 * total else "info"
    return Diagnosis("MEMORY_FRAGMENTATION", severity, why, tuple(tips), ev)


def _rank_imbalance(mem: dict[str, Any]) -> Diagnosis | None:
    peaks = {int(r): v["peak_allocated_mb"] for r, v in (mem.get("ranks") or {}).items()}
    if len(peaks) < 2:
        return None
    rank = max(peaks, key=lambda r: (peaks[r], -r))  # the largest bounds the job: every rank runs the same batch
    median = statistics.median(v for r, v in peaks.items() if r != rank)
    off = peaks[rank] - median
    if off < max(IMBALANCE_MIN_MB, IMBALANCE_SHARE * median):
        return None
    why = (f"rank {rank}'s peak allocated is {_gb(peaks[rank])}, {_gb(off)} above the other ranks' median "
           f"({_gb(median)}): the job's memory is bounded by its largest rank")
    tips = ("rank zero often holds more: logging, evaluation, a model copy or metrics kept only there",
            "uneven shards or sequence lengths per rank; an unsharded module under FSDP")
    ev = {"rank": rank, "rank_peak_mb": peaks[rank], "median_peak_mb": median, "peaks_mb": peaks}
    return Diagnosis("MEMORY_RANK_IMBALANCE", "medium", why, tips, ev)


def _headroom(mem: dict[str, Any]) -> Diagnosis | None:
    total, reserved, peak = mem.get("device_total_mb"), mem.get("peak_reserved_mb"), mem.get("peak_allocated_mb")
    act = _activations(mem)
    if not total or reserved is None or not peak or reserved > HEADROOM_SHARE * total:
        return None
    alloc = mem.get("allocated_mb") or {}
    fixed_of = alloc.get("forward_begin") or alloc.get("step_begin")
    on = f" (rank {mem['rank']}, the fullest)" if "rank" in mem else ""
    why = f"the peak reserved{on} is {_gb(reserved)} of the device's {_gb(total)} ({_pct(reserved / total)}): room to spare"
    ev: dict[str, Any] = {"peak_reserved_mb": reserved, "peak_allocated_mb": peak, "device_total_mb": total,
                          "activations_mb": act}
    tips = []
    if fixed_of is not None and act is not None and act > 0 and peak > fixed_of["mean"]:
        fixed = fixed_of["mean"]
        scale = (FILL_SHARE * total - fixed) / (peak - fixed)
        ev.update(fixed_mb=fixed, batch_scale=scale)
        if scale >= 1.5:
            said = f"about {scale:.1f}x" if scale <= 8 else "more than 8x"  # far from the data: no figure to trust
            why += (f"; a batch {said} larger would fit (an estimate: the peak less what is held when "
                    f"forward begins, {_gb(peak - fixed)}, grows with the batch; the {_gb(fixed)} held then "
                    f"(weights, gradients, optimizer state) does not; filled to {_pct(FILL_SHARE)} of the device)")
            tips.append(f"a larger batch ({said}), or fewer accumulation steps, uses the idle memory; "
                        "re-tune the learning rate with it")
    tips.append("or a larger model or longer sequences on the same device")
    return Diagnosis("MEMORY_HEADROOM", "info", why, tuple(tips), ev)
