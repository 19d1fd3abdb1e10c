"""``OUT_OF_MEMORY``: what an out-of-memory error that ended the run says, from what was known when it came."""

from __future__ import annotations

from typing import Any

from phase_timer.diagnosis.finding import (
    Diagnosis, OOM_ACTIVATIONS, OOM_FIRST_STEPS, OOM_FRAG_MIN_MB, OOM_OPTIMIZER, _pct,
)
from phase_timer.diagnosis.memory_rules import _activations, _creep, _expandable, _gb


def out_of_memory(oom: dict[str, Any], mem: dict[str, Any] | None) -> Diagnosis:
    """OUT_OF_MEMORY: where the run was when it ran out, what failed, what each phase held, and what to try,
    from what was measured (``oom``: ``phase_timer/measures/oom.py``'s facts; ``mem``: the memory summary, or None)."""
    n = _oom_numbers(oom, mem)
    when, said, creep = _oom_when(oom, mem)
    rank = oom.get("rank")
    why = ("the run" if rank is None else f"rank {rank}") + f" ran out of device memory {_oom_where(oom)}"
    if oom.get("requested_mb") is not None:
        why += f": an allocation of {_gb(oom['requested_mb'])} failed"
    if n["allocated"] is not None:
        why += f"; {_gb(n['allocated'])} allocated" + (f", {_gb(n['unallocated'])} more reserved but unallocated"
                                                        if n["unallocated"] is not None else "")
        if n["free"] is not None:
            why += f", {_gb(n['free'])} free on the device" + (f" of {_gb(n['total'])}" if n["total"] else "")
    held = _oom_held(oom)
    if held:
        why += f"; {held}"
    why += f"; {said}"
    tips = _oom_tips(oom, n, when, creep)
    ev = {**oom, "when": when, "activations_mb": n["activations"], "unallocated_mb": n["unallocated"],
          "needed_mb": n["needed"], "device_total_mb": n["total"], "expandable_segments": _expandable()}
    return Diagnosis("OUT_OF_MEMORY", "high", why, tuple(tips), ev)


def _oom_where(oom: dict[str, Any]) -> str:
    phase, step = oom.get("phase"), oom.get("step")
    warm = " (a warm-up step)" if oom.get("warmup") and oom.get("in_step") else ""
    if phase is None:
        return "(where in the step is not known: the run had ended)"
    if phase == "paused":
        phase = "paused (evaluation or validation)"
    if oom.get("in_step") and step is not None:
        return f"at step {step}{warm}, in {phase}"
    return f"in {phase}" + (f", after step {step}" if step is not None else ", before the first step")


def _oom_numbers(oom: dict[str, Any], mem: dict[str, Any] | None) -> dict[str, float | None]:
    """The figures at the failure: the allocator's message's where it gave them (they are of the failed allocation
    itself), else what the door read; activations, from the last memory step or the steady mean."""
    rep = oom.get("reported") or {}
    alloc = oom.get("allocator") or {}
    held = oom.get("held") or {}
    allocated = rep.get("allocated_mb", alloc.get("allocated_mb"))
    if "reserved_unallocated_mb" in rep:
        unallocated = rep["reserved_unallocated_mb"]
    elif alloc.get("reserved_mb") is not None and alloc.get("allocated_mb") is not None:
        unallocated = max(0.0, alloc["reserved_mb"] - alloc["allocated_mb"])
    else:
        unallocated = None
    act = (held.get("last_mb") or {}).get("activations")
    if act is None and mem:
        act = _activations(mem)
    req = oom.get("requested_mb")
    needed = allocated + req if allocated is not None and req is not None else None
    total = rep.get("total_mb", alloc.get("device_total_mb", (mem or {}).get("device_total_mb")))
    return {"allocated": allocated, "unallocated": unallocated, "free": rep.get("free_mb", alloc.get("device_free_mb")),
            "total": total, "activations": act, "needed": needed,
            "peak": (mem or {}).get("peak_allocated_mb") or alloc.get("peak_allocated_mb")}


def _oom_held(oom: dict[str, Any]) -> str | None:
    """What the last memory step saw each phase hold, in a clause (None: memory not read, or no step read yet)."""
    held = oom.get("held") or {}
    last = held.get("last_mb")
    if not last:
        return None
    parts = []
    if "step_begin" in last:
        parts.append(f"{_gb(last['step_begin'])} at the step's begin (weights, gradients, optimizer state)")
    if "activations" in last:
        parts.append(f"activations {_gb(last['activations'])}")
    peaks = held.get("phase_peaks_mb") or {}
    parts += [f"{phase} reached {_gb(mb)}" for phase, mb in peaks.items()]
    return f"the last memory step (step {held.get('last_step')}) held " + ", ".join(parts) if parts else None


def _oom_when(oom: dict[str, Any], mem: dict[str, Any] | None) -> tuple[str, str, Diagnosis | None]:
    """When it came: ``first`` steps, after a ``creep``, in a ``steady`` run that one step outgrew, or ``unknown``
    (memory not read); a clause that says so, and the creep's finding when there is one."""
    begun = oom.get("steps_begun") or 0
    if begun <= OOM_FIRST_STEPS:
        which = {0: "before its first step", 1: "in its first step", 2: "in its second step"}.get(
            begun, f"in its step {begun}")
        return "first", (f"it came {which}: one step never fit (the first optimizer step makes the optimizer's "
                         "state)"), None
    after = f"it came after {begun - 1} steps"
    creep = _creep(mem) if mem else None
    if creep is not None:
        c = creep.evidence
        return "creep", (f"{after}, allocated at the step's begin rising {c['mb_per_step']:.2f} MiB a step (steps "
                         f"{c['from_step']} to {c['to_step']}): what was kept across steps ran the device out"), creep
    if mem and mem.get("steady_samples"):
        at = (mem.get("allocated_mb") or {}).get("step_begin")
        steady = f" (about {_gb(at['mean'])} at the step's begin)" if at else ""
        return "steady", f"{after} with memory steady{steady}: this step needed more than the ones before", None
    return "unknown", (f"{after}; memory was not read on this device, so a creep cannot be told from one step that "
                       "needed more"), None


def _oom_tips(oom: dict[str, Any], n: dict[str, float | None], when: str, creep: Diagnosis | None) -> list[str]:
    tips = []
    if oom.get("snapshot"):
        tips.append(f"open {oom['snapshot']} at https://pytorch.org/memory_viz: every block alive at the failure, "
                    "and the Python line that allocated it")
    if creep is not None:
        tips.append(creep.next[0])
    act, ref = n["activations"], n["needed"] or n["peak"]
    phase = oom.get("phase")
    if (act is not None and ref and act >= OOM_ACTIVATIONS * ref) or (act is None and phase in ("forward", "backward")):
        size = f" ({_gb(act)}, {_pct(act / ref)} of what the step wanted)" if act is not None and ref else ""
        tips.append(f"activations{size}: activation checkpointing (torch.utils.checkpoint; the 🤗 model's "
                    "gradient_checkpointing_enable()), or a smaller micro-batch with more gradient accumulation "
                    "(the same batch per optimizer step)")
    unalloc, req = n["unallocated"], oom.get("requested_mb")
    if unalloc is not None and unalloc >= max(req or 0.0, OOM_FRAG_MIN_MB) and not _expandable():
        tips.append(f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: {_gb(unalloc)} was reserved but unallocated, "
                    "enough for the request, but in pieces")
    state = oom.get("state_mb") or {}
    opt, weights = state.get("optimizer_state_mb"), state.get("weights_mb")
    base = n["total"] or n["needed"]
    if opt and base and opt >= OOM_OPTIMIZER * base:
        times = f", {opt / weights:.1f}x the weights" if weights else ""
        tips.append(f"the optimizer's state is {_gb(opt)}{times}: a leaner optimizer (8-bit Adam, Adafactor, SGD with "
                    "momentum) or the state sharded across ranks (ZeRO, FSDP)")
    if when == "first":
        tips.append("bf16 autocast (halves activations), or shard the model and its state (FSDP) when one step cannot "
                    "fit on one device")
    elif when == "steady":
        tips.append("a batch larger than the others (a longer sequence, a bigger image): bound the length, or bucket "
                    "batches by size; or work outside the step on the training device (an evaluation, a checkpoint)")
    if not oom.get("snapshot"):
        tips.append("memory_snapshot=True records the allocator's history and dumps it at the next out-of-memory "
                    "error, for https://pytorch.org/memory_viz (it costs host time on every allocation: off by default)")
    return tips
