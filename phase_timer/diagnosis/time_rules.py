"""The rules of where a step's time goes: input, the copy to the device, Lightning's per-batch sync, the host or
the GPU as the bottleneck, a run that is unstable or changed, MFU."""

from __future__ import annotations

import statistics
from typing import Any

from phase_timer.diagnosis import run_change
from phase_timer.diagnosis.finding import (
    BEHIND_SHARE, Diagnosis, HOST_IDLE_SHARE, MATERIAL, MIN_FLIGHT_SAMPLES, MIN_WINDOWS, OPTIMIZER_SHARE,
    PACED_RATIO, SPIKE_MAX, SPIKE_P90, SPIKY_SHARE, _pct, _severity, phase_share,
)
from phase_timer.diagnosis.signals import Signals
from phase_timer.diagnosis.input_advice import Run, advise
from phase_timer.phases import exposed_wait, share_base


def _input_bound(totals: Any, signals: Signals, ctx: dict[str, Any], clock: str) -> Diagnosis | None:
    share = phase_share(totals, "data_wait", "period")
    if share is None or share < MATERIAL:
        return None
    wait = totals.phases["data_wait"]
    loader = ctx.get("loader")
    cores = ctx.get("cpu_count")
    cpu = signals.cpu.summary()
    period = totals.phases["period"]
    run = Run(period.mean, wait.mean, wait.quantile(50), cores, cpu)
    tips, found = advise(loader, run, ctx.get("device_type"))
    ev = {"share_of_period": share, "data_wait_ms": wait.mean, "data_wait_p50_ms": run.wait_p50, "loader": loader,
          "cpu_count": cores, "cpu": cpu, **found}
    exposed = None if ctx.get("fetch_in_step") else _exposed_wait(totals, signals, clock)  # inside the step: whole
    if exposed is None:  # the host clock: the whole wait is the loop's
        why = (f"the loop waits {wait.mean:.2f} ms a step for its next batch: {_pct(share)} of the time per step "
               "(data_wait of period)")
        return Diagnosis("INPUT_BOUND", _severity(share), why, tuple(tips), ev)
    idle = exposed  # ms a step
    seen = idle / period.mean
    ev.update(share_of_period=seen, data_wait_share_of_period=share, data_wait_exposed_ms=idle, hidden=seen < MATERIAL)
    if seen >= MATERIAL:
        why = (f"the loop waits {wait.mean:.2f} ms a step for its next batch and {idle:.2f} ms a step of it reaches "
               f"the device (its idle before the step): {_pct(seen)} of the time per step (data_wait's exposed part, "
               "of period)")
        return Diagnosis("INPUT_BOUND", _severity(seen), why, tuple(tips), ev)
    why = (f"the host waits {wait.mean:.2f} ms a step for its next batch ({_pct(share)} of period), hidden behind the "
           f"device's queue (the device idled {idle:.2f} ms a step before its steps): nothing to gain now; it will "
           "show once the step gets faster than the loader")
    tips = ["nothing to change now: the device runs queued work through the wait; for when the step gets faster: "
            + tips[0], *tips[1:]] if tips else ["nothing to change now: the device runs queued work through the wait"]
    return Diagnosis("INPUT_BOUND", "info", why, tuple(tips), ev)


def _exposed_wait(totals: Any, signals: Signals, clock: str) -> float | None:
    """The ``data_wait`` that reached the device, ms a step (``phases.exposed_wait``): each window's own
    (``Signals.add_wait``), or, where no window was added (the run totals alone), the run's.  None on the host
    clock: there the whole wait is exposed."""
    if clock == "host":
        return None
    if signals.wait_steps:
        return signals.wait_exposed_ms / signals.wait_steps
    phases = totals.phases
    return exposed_wait({p: t.total for p, t in phases.items()}, {p: t.count for p, t in phases.items()}, totals.steps)


def _h2d_bound(totals: Any, ctx: dict[str, Any], clock: str) -> Diagnosis | None:
    share = phase_share(totals, "h2d", "step")
    if share is None or share < MATERIAL:
        return None
    h2d = totals.phases["h2d"].mean
    ev = {"share_of_step": share, "share_of_period": phase_share(totals, "h2d", "period") or share, "h2d_ms": h2d}
    if clock == "host":
        # No device copy to speed up: on the host clock ``h2d`` is the loop's own work between
        # the batch in hand and the model's call (or the wrapper's copy), so the copy advice is wrong.
        why = (f"the loop spends {h2d:.2f} ms a step between the batch in hand and the model's call: "
               f"{_pct(share)} of the step (h2d, on the host clock: the loop's own work there, not a device copy)")
        tips = ("look at what runs between the fetch and the forward: conversions (.to(dtype), .float()), "
                "per-batch preprocessing; move it into the DataLoader's workers",)
        return Diagnosis("H2D_BOUND", _severity(share), why, tips, ev)
    loader = ctx.get("loader") or {}
    tips = []
    if loader.get("pin_memory") is False:
        tips.append("pin_memory=False: pin the batches (DataLoader(pin_memory=True)) and copy with non_blocking=True")
    else:
        tips.append("copy from pinned memory with non_blocking=True, so the copy overlaps compute")
    tips += ["send smaller dtypes (uint8 images, normalized on the GPU; int32 token ids)",
             "augment on the GPU rather than shipping augmented float batches"]
    why = f"the host-to-device copy takes {h2d:.2f} ms a step: {_pct(share)} of the step"
    return Diagnosis("H2D_BOUND", _severity(share), why, tuple(tips), ev)


def _sync_wait(totals: Any) -> Diagnosis | None:
    share = phase_share(totals, "sync_wait", "period")
    if share is None or share < MATERIAL:
        return None
    sw = totals.phases["sync_wait"].mean
    why = (f"Lightning's per-batch broadcast waits {sw:.2f} ms a step ({_pct(share)} of period): the host waits there "
           "for the device to finish and for the other ranks to arrive")
    tips = ("it is Lightning's check for a SIGTERM on any rank, read with .item(): its wait is the slowest rank's "
            "lead, or the device's queue draining; see the per-rank table for a slow rank",
            "a host that cannot queue ahead across batches loses this time every step")
    return Diagnosis("SYNC_WAIT", _severity(share), why, tips, {"share_of_period": share, "sync_wait_ms": sw})


def _flight(signals: Signals) -> tuple[int, float, float] | None:
    """(samples, share at 0 in flight, median in flight), or None when too few samples."""
    n = sum(signals.flight.values())
    if n < MIN_FLIGHT_SAMPLES:
        return None
    values = sorted(signals.flight.elements())
    return n, signals.flight[0] / n, float(statistics.median(values))


def _paced_ratio(totals: Any, signals: Signals) -> float | None:
    """The device's median step over the sampled steps' median host time to issue one (None: no samples).

    Medians: a few slow steps (a logging step, a collection) must not decide it from a handful of samples
    (a host-bound Lightning loop read 1.30 on means, 2.96 ms against 2.28, in one run of 100 steps)."""
    step = totals.phases.get("step")
    if step is None or len(signals.host_step_ms) < MIN_FLIGHT_SAMPLES:
        return None
    host = statistics.median(signals.host_step_ms)
    return step.quantile(50) / host if host > 0 else None


def _behind(signals: Signals) -> float | None:
    """The share of sampled boundaries at which the device was more than a phase behind (None: too few)."""
    if signals.behind_checked < MIN_FLIGHT_SAMPLES:
        return None
    return signals.behind / signals.behind_checked


def _host_bound(totals: Any, signals: Signals, clock: str, syncs: Any) -> Diagnosis | None:
    flight = _flight(signals) if clock != "host" else None
    ratio = _paced_ratio(totals, signals)
    if flight is None or ratio is None:
        return None
    n, idle, _ = flight
    if idle < HOST_IDLE_SHARE or ratio >= PACED_RATIO:
        return None
    behind = _behind(signals)
    if behind is not None and behind >= BEHIND_SHARE:
        # The host took as long as the device only because the device held it back (a full launch
        # queue: thousands of kernels a step, each longer than its launch), not the reverse.
        return None
    why = (f"the device keeps pace with the host: in {_pct(idle)} of {n} sampled steps it had finished every earlier "
           f"step when the host ended one, and its step ({totals.phases['step'].quantile(50):.2f} ms) lasts {ratio:.2f}x the "
           "host's time to issue it; the device phases then include the GPU's wait for launches")
    tips = ["do more per launch: a bigger batch, torch.compile (mode='reduce-overhead' adds CUDA graphs)",
            "a fused or foreach optimizer (e.g. AdamW(fused=True)); fewer small ops on the host"]
    said = _syncs_said(syncs)
    if said is None:
        tips.insert(0, "find host-device syncs inside the step: torch.cuda.set_sync_debug_mode('warn')")
    else:
        why += f"; {said[0]}"
        tips[:0] = said[1]
    ev = {"samples": n, "share_at_zero_in_flight": idle, "device_over_host_step": ratio,
          "host_step_ms": statistics.median(signals.host_step_ms), "tail_busy": signals.tail_busy,
          "tail_checked": signals.tail_checked, "behind": signals.behind, "behind_checked": signals.behind_checked,
          **_census_evidence(syncs)}
    return Diagnosis("HOST_BOUND", "high" if idle >= 0.9 and ratio < 1.1 else "medium", why, tuple(tips), ev)


def _unstable(signals: Signals) -> Diagnosis | None:
    n = signals.windows
    if n < MIN_WINDOWS or signals.spiky_windows <= SPIKY_SHARE * n:
        return None
    why = (f"{signals.spiky_windows} of {n} windows are spiky (step or period p90/p50 >= {SPIKE_P90} or "
           f"max/p50 >= {SPIKE_MAX}): the mean hides slow steps")
    tips = ("look for periodic host work: garbage collection (gc.freeze() after set-up), checkpoints, logging or "
            ".item() every step, data stalls (see data_wait's max)",
            "the per-step view (per_step=True) or a trace (trace_steps=...) shows which steps are slow")
    return Diagnosis("UNSTABLE", "medium", why, tips, {"spiky_windows": signals.spiky_windows, "windows": n})


def _run_changed(totals: Any, signals: Signals) -> Diagnosis | None:
    """RUN_CHANGED (``phase_timer.diagnosis.run_change``): a phase's level moved partway through the run and stayed."""
    if signals.series is None:
        return None
    scale = totals.phases.get("period") or totals.phases.get("step")
    found = run_change.finding(signals.series, scale.quantile(50) if scale is not None else None,
                               signals.rank_shifts if signals.rank_shifts.points else None)
    return Diagnosis("RUN_CHANGED", *found) if found is not None else None


def _gpu_bound(totals: Any, signals: Signals, clock: str, ctx: dict[str, Any], syncs: Any) -> Diagnosis | None:
    flight = _flight(signals) if clock != "host" else None
    ratio = _paced_ratio(totals, signals)
    if flight is None:
        return None
    n, idle, median = flight
    behind = _behind(signals)
    lagging = behind is not None and behind >= BEHIND_SHARE
    if median < 1 and (ratio is None or ratio < PACED_RATIO) and not lagging:
        return None
    step = totals.phases["step"]
    inner = {p: t for p, t in totals.phases.items() if share_base(p) == "step"}  # custom ones after the end are not
    largest = max(inner, key=lambda p: inner[p].total) if inner else "step"
    share = inner[largest].total / step.total if inner and step.total > 0 else 1.0
    if median >= 1:
        lead = f"the host runs ahead (median {median:g} earlier step(s) in flight)"
    elif ratio is not None and ratio >= PACED_RATIO:
        lead = f"the device's step ({step.quantile(50):.2f} ms, median) lasts {ratio:.2f}x the host's time to issue it"
    else:
        lead = (f"inside the step the device runs more than a phase behind the host (at {_pct(behind or 0.0)} of "
                "sampled boundaries): the host issues work faster than the device runs it")
    why = f"the GPU is the bottleneck: {lead}; {largest} is {_pct(share)} of the step"
    tips = [f"make {largest} cheaper on the GPU: it is the largest phase"]
    opt = phase_share(totals, "optimizer", "step")
    if opt is not None and opt >= OPTIMIZER_SHARE:
        tips.append(f"the optimizer is {_pct(opt)} of the step: a fused optimizer (fused=True) or foreach")
    precision = ctx.get("precision")
    mfu_tips = ctx.get("mfu_tips") or []
    if mfu_tips:  # MFU is low: why, then which phase is far from the peak and what lifts it (precision too)
        why += f"; {mfu_tips[0]}"
        tips = [tips[0], *mfu_tips[1:]]
    elif precision in ("32", "32-true", "fp32", "float32"):
        tips.append("the run is in fp32: bf16 autocast (precision='bf16-mixed') or TF32 matmuls "
                    "(torch.set_float32_matmul_precision('high'))")
    ev = {"samples": n, "median_in_flight": median, "largest_phase": largest, "largest_share_of_step": share,
          "precision": precision, "tail_busy": signals.tail_busy, "tail_checked": signals.tail_checked,
          "behind": signals.behind, "behind_checked": signals.behind_checked}
    if ratio is not None:
        ev["device_over_host_step"] = ratio
    ev.update(_census_evidence(syncs))
    if idle >= HOST_IDLE_SHARE:
        said = _syncs_said(syncs)
        why += f"; but the host never got a step ahead in {_pct(idle)} of sampled steps: "
        if said is None:
            why += ("something waits for the GPU inside each step (.item(), .cpu(), printing a tensor), or the host "
                    "issues a step about as fast as the device runs it, so the host cannot queue ahead")
            tips.append("find a per-step sync with torch.cuda.set_sync_debug_mode('warn'); read values every N steps")
        else:
            why += said[0] + ("" if syncs is not None and syncs.sites else ", so the host issues a step about as fast as the device "
                              "runs it (a full launch queue)")
            tips[:0] = said[1]
    return Diagnosis("GPU_BOUND", "info", why, tuple(tips), ev)


def _mfu_impossible(mfu: list[str]) -> Diagnosis | None:
    """An MFU over 100% (``mfu.mfu_advice`` says only that): the FLOP count or the peak is wrong."""
    if not mfu or not mfu[0].startswith("MFU over 100%"):
        return None
    return Diagnosis("MFU_IMPOSSIBLE", "medium", mfu[0].split(" cannot be")[0] + " cannot be right",
                     (mfu[0],), {})


def _stepping(site: Any) -> bool:
    """A sync inside the step (not in the fetch, between steps, or in a pause)."""
    return share_base(site.phase) == "step"


def _syncs_said(census: Any) -> tuple[str, list[str]] | None:
    """What the census heard, for a verdict about a host that never gets ahead: a clause for ``why``, and
    what to try (each site's known cause first, then what is left when those are off).  None: no census."""
    if census is None or census.status != "done":
        return None
    syncs = sorted(census.sites, key=lambda s: (not _stepping(s), -s.count))
    step = census.warmup_step
    if not syncs:
        return f"torch flags no host-device sync in a whole step (census of warm-up step {step})", []
    inside = sum(s.count for s in syncs if _stepping(s))
    between = sum(s.count for s in syncs) - inside
    counts = [f"{n} time(s) inside each step" for n in (inside,) if n] + [f"{n} time(s) outside it" for n in (between,) if n]
    sites = "; ".join(f"{s.count}x in {s.phase} at {s.frames[0] if s.frames else s.where}" for s in syncs[:4])
    clause = f"the host waits for the device {' and '.join(counts)} (census of warm-up step {step}: {sites})"
    tips = list(dict.fromkeys(s.cause for s in syncs if s.cause))
    unknown = [s for s in syncs if not s.cause]
    if unknown:
        where = "; ".join(f"{s.count}x in {s.phase}: `{s.code}` at {s.frames[0] if s.frames else s.where}"
                          for s in unknown[:3])
        lead = "left when those are off: " if tips else ""
        tips.append(f"{lead}{where}: read such values every N steps, or keep them on the device")
    elif tips:
        tips.append("no other sync is left when those are off")
    return clause, tips


def _census_evidence(census: Any) -> dict[str, Any]:
    """The census in a finding's evidence (a run without one: not run)."""
    if census is None:
        return {"sync_census": "not run", "syncs": []}
    return {"sync_census": census.status, "syncs": [s.as_dict() for s in census.sites]}
