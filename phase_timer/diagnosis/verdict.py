"""The verdict: every rule over one run, the findings in order, the primary and the rest; the verdict as text."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from phase_timer.diagnosis.finding import Diagnosis, MIN_STEPS
from phase_timer.diagnosis.memory_rules import memory_findings
from phase_timer.diagnosis.module_rules import with_modules
from phase_timer.diagnosis.oom_rules import out_of_memory
from phase_timer.diagnosis.rank_rules import _comm_bound, _straggler
from phase_timer.diagnosis.signals import Signals
from phase_timer.diagnosis.time_rules import (
    _gpu_bound, _h2d_bound, _host_bound, _input_bound, _mfu_impossible, _run_changed, _sync_wait, _unstable,
)


def diagnose(totals: Any, signals: Signals, *, clock: str, context: dict[str, Any] | None = None,
             rank_totals: Any = None, skipped: int = 0, warmup_steps: int | None = None,
             memory: dict[str, Any] | None = None, mfu: list[str] | None = None,
             oom: dict[str, Any] | None = None, syncs: Any = None,
             modules: dict[str, Any] | None = None) -> Diagnosis:
    """The primary finding (with the others as ``secondary``) for a run's totals and signals.

    ``memory``: the memory summary (``measures.memory.Memory.summary``); its findings come after the time ones,
    except a high one, which comes first.  ``mfu``: what MFU says (``mfu.mfu_advice``): a GPU-bound run's
    tips at low MFU, or that an MFU over 100% cannot be (``MFU_IMPOSSIBLE``).  ``oom``: what was known when an
    out-of-memory error ended the run (``measures.oom.OutOfMemory``; None: none did): ``OUT_OF_MEMORY`` then leads, whatever the number
    of steps, and the rest follows it.  ``syncs``: what the sync census heard (``measures.syncs.Syncs``; None:
    no census), which the host- and GPU-bound findings name.  ``modules``: the modules block
    (``measures/modules/``): GPU_BOUND names the module that holds the most of the slow phase, the memory findings
    the modules that keep the activations."""
    found = _findings(totals, signals, clock=clock, context=context, rank_totals=rank_totals, skipped=skipped,
                      warmup_steps=warmup_steps, memory=memory, mfu=mfu, syncs=syncs)
    if not oom:
        return with_modules(found, modules)
    rest = () if found.kind in ("NO_FINDING", "TOO_FEW_STEPS") else (replace(found, secondary=()),)
    return with_modules(replace(out_of_memory(oom, memory), secondary=rest + found.secondary), modules)


def _findings(totals: Any, signals: Signals, *, clock: str, context: dict[str, Any] | None,
              rank_totals: Any, skipped: int, warmup_steps: int | None, memory: dict[str, Any] | None,
              mfu: list[str] | None = None, syncs: Any = None) -> Diagnosis:
    """The time and memory rules' verdict."""
    ctx = dict(context or {})
    mfu = list(mfu or ())
    impossible = _mfu_impossible(mfu)
    if impossible is None:
        ctx["mfu_tips"] = mfu
    steps = totals.steps
    mem = memory_findings(memory)
    if steps < MIN_STEPS:
        need = f"at least {MIN_STEPS} timed steps" + (
            f" (run {MIN_STEPS + warmup_steps}+ steps with warmup_steps={warmup_steps})" if warmup_steps is not None else "")
        return Diagnosis("TOO_FEW_STEPS", "info", f"{steps} step(s) timed: too few to say what holds the run back",
                         (f"time {need}",), {"steps_timed": steps, "needed": MIN_STEPS}, tuple(mem))
    found = [f for f in (
        _input_bound(totals, signals, ctx, clock), _h2d_bound(totals, ctx, clock), _sync_wait(totals),
        _straggler(signals, rank_totals, clock), _comm_bound(totals, rank_totals, signals.fsdp2),
    ) if f is not None]
    hidden = [f for f in found if f.severity == "info"]  # a host's wait the device's queue hid: said after the rest
    found = [f for f in found if f.severity != "info"]
    found.sort(key=lambda f: -f.evidence["share_of_period"])
    host = _host_bound(totals, signals, clock, syncs)
    if host is not None:
        found.append(host)
    unstable = _unstable(signals)
    if unstable is not None:
        found.append(unstable)
    changed = _run_changed(totals, signals)
    if changed is not None and changed.severity != "info":  # a change of a tenth of the period or more leads
        found.append(changed)
    if impossible is not None:
        found.append(impossible)
    if not any(f.kind in ("INPUT_BOUND", "H2D_BOUND", "SYNC_WAIT", "HOST_BOUND") for f in found):
        gpu = _gpu_bound(totals, signals, clock, ctx, syncs)
        if gpu is not None:
            found.append(gpu)
    found += hidden
    if changed is not None and changed.severity == "info":  # a smaller one: said, after what holds the run back
        found.append(changed)
    found = [f for f in mem if f.severity == "high"] + found + [f for f in mem if f.severity != "high"]
    if all(f.kind.startswith("MEMORY_") and f.severity == "info" for f in found):  # memory's notes are no verdict
        mem_notes, found = tuple(found), []
    else:
        mem_notes = ()
    if not found:
        why = ("no rule fired" + ("; the run is on the host clock, so the device rules (HOST_BOUND, GPU_BOUND) have "
                                  "no signal" if clock == "host" else "; too few sampled steps for the device rules"))
        return Diagnosis("NO_FINDING", "info", why, ("see the table: the largest phase is where the time goes",),
                         {"steps_timed": steps, "skipped_steps": skipped}, mem_notes)
    first, *rest = found
    return Diagnosis(first.kind, first.severity, first.why, first.next, first.evidence, tuple(rest))


def format_verdict(d: Diagnosis) -> str:
    """The verdict in a few lines: the kind and why, what to try, the other findings."""
    lines = [f"verdict: {d.kind} ({d.severity}): {d.why}"]
    lines += [f"  next: {tip}" for tip in d.next[:3]]
    if d.secondary:
        lines.append("  also: " + "; ".join(f"{s.kind} ({s.why.split(':')[0]})" for s in d.secondary))
    return "\n".join(lines)
