"""The rules across ranks: the straggler (by its phase, or by the others' waits for it) and exposed communication."""

from __future__ import annotations

import statistics
from typing import Any

from phase_timer.diagnosis.finding import (
    COMM_MATERIAL, Diagnosis, MIN_WINDOWS, STRAGGLER_MARGIN, STRAGGLER_SHARE, WAIT_PHASES, _pct, _severity,
)
from phase_timer.diagnosis.signals import Signals
from phase_timer.phases import COMM_PARTS, EXPOSED_WAIT, HOST_PHASES, comm_label, exposed_wait


def _straggler(signals: Signals, rank_totals: Any, clock: str = "host") -> Diagnosis | None:
    """RANK_STRAGGLER: one rank slowest in one phase in most windows, by a material margin over the other ranks'
    median; or, where the collectives equalise the steps and no phase shows it (or the others wait longer for
    another rank than that phase is slow), the rank the others wait for.  On a device clock a rank slowest in a
    host-clock phase (``data_wait``) is a straggler only where that time reaches the device (its device idles before
    its steps) or the other ranks wait for it in their collectives; else it is said as ``info`` (hidden behind its
    device's queue), and the next slowest (rank, phase) may be the straggler.  A rank named by a phase is also said
    with its pauses outside its steps (evaluation on that rank alone), where they are material."""
    n = len(signals.rank_period_ms)  # the windows across ranks
    if n < 1:
        return None
    period = statistics.median(signals.rank_period_ms)
    floor = max(0.05, STRAGGLER_MARGIN * period)
    found = hidden = None
    ranked = sorted(signals.slowest.items(), key=lambda kv: (kv[1], signals.margins[kv[0]]), reverse=True)
    for (phase, rank), count in ranked:
        if count < max(MIN_WINDOWS, STRAGGLER_SHARE * n):
            break
        reach = (_reach(rank_totals, rank, signals.margins[phase, rank] / count)
                 if phase in HOST_PHASES and clock != "host" else None)
        if reach is not None and reach[0] < floor:
            hidden = hidden or (phase, rank, signals.margins[phase, rank] / count, count, reach)
            continue
        found = (phase, rank, signals.margins[phase, rank] / count, count, reach)
        break
    waited = _waited_for(rank_totals, period)
    if waited is not None and (found is None or waited[0] != found[1] and waited[1] > found[2]):
        return _straggler_by_waits(rank_totals, period, n, *waited)
    if found is None and hidden is not None:
        return _hidden_straggler(period, n, *hidden)
    if found is None:
        return None
    phase, rank, margin, count, reach = found
    share = (reach[0] if reach is not None else margin) / period if period > 0 else 0.0
    ev: dict[str, Any] = {"rank": rank, "phase": phase, "margin_ms": margin, "windows": count, "of_windows": n,
                          "share_of_period": share, "by": "phase"}
    why = (f"rank {rank} is the slowest in {phase} in {count} of {n} windows, {margin:.2f} ms a step above the "
           f"other ranks' median ({_pct(share)} of period)")
    if reach is not None:
        ev.update(_reach_evidence(reach), hidden=False)
        why = (f"rank {rank} is the slowest in {phase} in {count} of {n} windows, {margin:.2f} ms a step above the "
               f"other ranks' median, and {reach[0]:.2f} ms a step of it reaches the devices ({_pct(share)} of "
               f"period; {_reach_said(rank, reach)})")
    tips = [_look_at(rank, phase)]
    wait = _others_wait(rank_totals, rank)
    if wait is not None:
        wait, split, others = wait
        ev["others_backward_wait_ms"] = wait  # the name kept where the waits are split too: the extra wait
        if wait > 0 and split:
            ev["others_comm_wait_ms"] = others
            tips.append(f"the other ranks wait {wait:.2f} ms a step longer than rank {rank} for their collectives "
                        f"(their exposed communication, {' + '.join(_parts(rank_totals))}): that is rank {rank}'s "
                        "lag reaching them, not the network")
        elif wait > 0:
            tips.append(f"the other ranks' backward is {wait:.2f} ms longer than rank {rank}'s: their wait for it "
                        "in the gradient all-reduce")
    tips += _pauses_tip(rank_totals, rank, period, ev)
    return Diagnosis("RANK_STRAGGLER", "high" if share >= 0.2 else "medium", why, tuple(tips + _input_tip(phase)), ev)


def _others_wait(rank_totals: Any, rank: int) -> tuple[float, bool, float] | None:
    """How much longer the other ranks wait than ``rank`` a step (their median): in their split waits (every
    ``comm_wait`` row) where there are any, else in ``backward``; whether split; their median wait.  None: no
    per-rank totals, or no wait to compare."""
    if rank_totals is None:
        return None
    split = bool(_parts(rank_totals))
    mine = _rank_wait(rank_totals, rank, split)
    if split and mine is None:  # a rank that never waited
        mine = 0.0
    others = [m for r in rank_totals.sums if r != rank and (m := _rank_wait(rank_totals, r, split)) is not None]
    if mine is None or not others:
        return None
    return statistics.median(others) - mine, split, statistics.median(others)


def _rank_exposed(rank_totals: Any, rank: int) -> float | None:
    """Rank ``rank``'s ``data_wait`` that reached its device, ms a step (device clock): from its own windows, as it
    sent them (``phases.EXPOSED_WAIT``), else from its run totals (``phases.exposed_wait``); None: unknown."""
    counts = (getattr(rank_totals, "counts", None) or {}).get(rank) or {}
    sums = rank_totals.sums.get(rank) or {}
    steps = (getattr(rank_totals, "steps", None) or {}).get(rank) or max((c for _, c in sums.values()), default=0)
    if EXPOSED_WAIT in counts and steps:
        return counts[EXPOSED_WAIT] / steps
    return exposed_wait({p: acc[0] for p, acc in sums.items()}, {p: int(acc[1]) for p, acc in sums.items()}, steps)


def _reach(rank_totals: Any, rank: int, margin: float) -> tuple[float, float | None, float | None] | None:
    """How much of a rank's lag in a host-clock phase (``margin`` ms a step above the others' median) reaches the
    devices, ms a step: (its device's idle before its steps above the other ranks' median where known, else the
    others' longer wait for it in their collectives, at most ``margin``; that idle above theirs; that wait).  Where
    the rank's own idle is known it decides: a lag its own device never felt is not what the others wait for (their
    wait then has another cause: its pauses, host work outside the phases).  None where neither is known (no
    per-rank totals): the phase is taken as it is."""
    if rank_totals is None or rank not in rank_totals.sums:
        return None
    mine = _rank_exposed(rank_totals, rank)
    theirs = [e for r in rank_totals.sums if r != rank and (e := _rank_exposed(rank_totals, r)) is not None]
    idle = mine - (statistics.median(theirs) if theirs else 0.0) if mine is not None else None
    wait = _others_wait(rank_totals, rank)
    waited = wait[0] if wait is not None else None
    if idle is None and waited is None:
        return None
    felt = idle if idle is not None else waited
    return min(margin, max(0.0, felt or 0.0)), idle, waited


def _reach_evidence(reach: tuple[float, float | None, float | None]) -> dict[str, Any]:
    return {"reaches_ms": reach[0], "device_idle_over_others_ms": reach[1], "others_wait_longer_ms": reach[2]}


def _reach_said(rank: int, reach: tuple[float, float | None, float | None]) -> str:
    _, idle, wait = reach
    parts = []
    if idle is not None:
        parts.append(f"rank {rank}'s device idles {max(idle, 0.0):.2f} ms a step more than the others' before its steps")
    if wait is not None:
        parts.append(f"the other ranks wait {max(wait, 0.0):.2f} ms a step longer for it in their collectives")
    return ", ".join(parts)


def _hidden_straggler(period: float, n: int, phase: str, rank: int, margin: float, count: int,
                      reach: tuple[float, float | None, float | None]) -> Diagnosis:
    """RANK_STRAGGLER (info): a rank slowest in a host-clock phase whose time its device's queue hides."""
    share = reach[0] / period if period > 0 else 0.0
    ev: dict[str, Any] = {"rank": rank, "phase": phase, "margin_ms": margin, "windows": count, "of_windows": n,
                          "share_of_period": share, "by": "phase", "hidden": True, **_reach_evidence(reach)}
    why = (f"rank {rank} is the slowest in {phase} in {count} of {n} windows, {margin:.2f} ms a step above the other "
           f"ranks' median, hidden behind its device's queue ({_reach_said(rank, reach)}): nothing to gain now; it "
           f"will show once the step gets faster than rank {rank}'s {phase}")
    tips = (f"nothing to change now; for when the step gets faster: {_look_at(rank, phase)}", *_input_tip(phase))
    return Diagnosis("RANK_STRAGGLER", "info", why, tips, ev)


def _straggler_by_waits(rank_totals: Any, period: float, n: int, rank: int, gap: float,
                        where: tuple[str, float] | None) -> Diagnosis:
    """RANK_STRAGGLER from the split waits (:func:`_waited_for`): the rank the others wait ``gap`` ms a step for,
    and where it loses that time: a phase, its pauses, or neither."""
    share = gap / period if period > 0 else 0.0
    ev: dict[str, Any] = {"rank": rank, "phase": where[0] if where else None, "margin_ms": gap, "windows": 0,
                          "of_windows": n, "share_of_period": share, "others_comm_wait_ms": gap, "by": "waits"}
    why = (f"rank {rank} is the one the others wait for: the other ranks wait {gap:.2f} ms a step longer than "
           f"rank {rank} for its collectives ({_pct(share)} of period; {' + '.join(_parts(rank_totals))}): the "
           "collectives make every rank's step as long as the slowest's, so only the waits show who it is")
    tips = _pauses_tip(rank_totals, rank, period, ev)
    if where:
        tips.append(f"rank {rank} spends {where[1]:.2f} ms a step more than the other ranks in {where[0]}: "
                    + _look_at(rank, where[0]))
    elif not tips:
        tips.append(f"no timed phase of rank {rank}'s is longer than the others': its lag is host work the device "
                    "does not see as a phase (Python between launches, logging, checkpoints or evaluation on that "
                    "rank alone); trace that rank (trace_steps=) to find it")
    return Diagnosis("RANK_STRAGGLER", "high" if share >= 0.2 else "medium", why,
                     tuple(tips + _input_tip(where[0] if where else None)), ev)


def _pauses_tip(rank_totals: Any, rank: int, period: float, ev: dict[str, Any]) -> list[str]:
    """The rank's pauses outside its steps (evaluation, checkpoints, logging on that rank alone), where they are
    material: the tip, and their figures in ``ev``; else nothing."""
    paused = _paused(rank_totals, rank)
    if paused is None or paused[0] < max(0.05, STRAGGLER_MARGIN * period):
        return []
    more, own, theirs, pauses, steps = paused
    ev.update(paused_ms_per_step=own, others_paused_ms_per_step=theirs, pauses=pauses)
    return [f"rank {rank} pauses {own:.2f} ms a step on average outside its steps ({pauses} pauses over {steps} "
            f"steps, one every ~{steps / pauses:.0f} steps: evaluation, checkpoints, logging), {more:.2f} ms more "
            "than the other ranks' median: each pause is their wait in their next collective. Run that work on "
            "every rank at the same step (evaluation sharded across the ranks), or outside training"]


def _look_at(rank: int, phase: str) -> str:
    return (f"look at rank {rank}'s {phase}: its data shard, its host (other jobs, CPU affinity), its GPU (clocks, "
            "thermals, PCIe)")


def _input_tip(phase: str | None) -> list[str]:
    return ["an uneven input pipeline: the same loader settings on every rank, shards of even cost"] \
        if phase == "data_wait" else []


def _paused(rank_totals: Any, rank: int) -> tuple[float, float, float, int, int] | None:
    """Rank ``rank``'s pauses (evaluation, saves: no step's) beside the other ranks': (ms a step more than their
    median, its own ms a step, their median, its pauses, its steps); None where the ranks' reports carry none."""
    counts = getattr(rank_totals, "counts", None) or {}
    steps = getattr(rank_totals, "steps", None) or {}

    def per_step(r: int) -> float:
        n = steps.get(r) or 0
        return (counts.get(r, {}).get("paused_ms", 0.0) / n) if n else 0.0

    if not counts.get(rank, {}).get("pauses") or not steps.get(rank):
        return None
    others = [per_step(r) for r in rank_totals.sums if r != rank]
    theirs = statistics.median(others) if others else 0.0
    return per_step(rank) - theirs, per_step(rank), theirs, int(counts[rank]["pauses"]), int(steps[rank])


def _waited_for(rank_totals: Any, period: float) -> tuple[int, float, tuple[str, float] | None] | None:
    """The rank every other rank waits for, from the split waits over the run: the one that waits least, by a
    material margin under the median of the rest (each other rank's wait above it is its lag reaching them);
    with the phase where it spends the most time above the others' median, if one does by that margin.  None:
    no split waits, fewer than two ranks, or no such rank."""
    if rank_totals is None or len(rank_totals.sums) < 2 or not _parts(rank_totals):
        return None
    # a rank with no comm_wait row but a backward never waited; one with neither says nothing
    waits = {r: w if w is not None else 0.0 for r in rank_totals.sums
             if (w := _rank_wait(rank_totals, r, True)) is not None or rank_totals.mean(r, "backward") is not None}
    if len(waits) < 2:
        return None
    slow = min(waits, key=lambda r: (waits[r], r))
    rest = [w for r, w in waits.items() if r != slow]
    gap = statistics.median(rest) - waits[slow]
    floor = max(0.05, STRAGGLER_MARGIN * period)
    if gap < floor or not all(w - waits[slow] >= floor for w in rest):
        return None
    best: tuple[str, float] | None = None
    phases = {p for sums in rank_totals.sums.values() for p in sums}
    for phase in sorted(phases):
        if phase in WAIT_PHASES or phase == "paused":
            continue
        mine = rank_totals.mean(slow, phase)
        others = [m for r in rank_totals.sums if r != slow and (m := rank_totals.mean(r, phase)) is not None]
        if mine is None or not others:
            continue
        over = mine - statistics.median(others)
        if over >= floor and (best is None or over > best[1]):
            best = (phase, over)
    return slow, gap, best


def _exposed(mean: Any) -> float | None:
    """The exposed communication a step: the sum of every "of which" comm wait ``mean(part)`` has (None: none)."""
    got = [v for part in COMM_PARTS if (v := mean(part)) is not None]
    return sum(got) if got else None


def _rank_wait(rank_totals: Any, rank: int, split: bool) -> float | None:
    """Rank ``rank``'s measured wait a step: every "of which" comm wait where the waits are split, else backward."""
    if split:
        return _exposed(lambda part: rank_totals.mean(rank, part))
    return rank_totals.mean(rank, "backward")


def _parts(rank_totals: Any) -> list[str]:
    """The comm waits any rank has, in the table's order."""
    return [p for p in COMM_PARTS if any(rank_totals.mean(r, p) is not None for r in rank_totals.sums)]


def _comm_bound(totals: Any, rank_totals: Any, fsdp2: bool = False) -> Diagnosis | None:
    """COMM_BOUND: the exposed communication (``forward.comm_wait`` + ``backward.comm_wait``) is COMM_MATERIAL of the
    step or more on the rank that waits least: even the rank everyone else waits for waits on the network, so no
    straggler explains it."""
    parts = [p for p in COMM_PARTS if p in totals.phases]
    step = totals.phases.get("step")
    if not parts or step is None or step.total <= 0:
        return None
    share = sum(totals.phases[p].total for p in parts) / step.total
    rank, wait_ms = None, sum(totals.phases[p].mean for p in parts)
    if rank_totals is not None:
        by_rank = {r: (w / s, w) for r in rank_totals.sums
                   if (w := _rank_wait(rank_totals, r, True)) is not None
                   and (s := rank_totals.mean(r, "step"))}
        if len(by_rank) >= 2:
            rank = min(by_rank, key=lambda r: by_rank[r][0])
            share, wait_ms = by_rank[rank]
    if share < COMM_MATERIAL:
        return None
    period = totals.phases.get("period")
    ev = {"share_of_step": share, "comm_wait_ms": wait_ms, "least_waiting_rank": rank, "parts": parts,
          "share_of_period": wait_ms / period.mean if period is not None and period.mean > 0 else share}
    who = f" on rank {rank}, the rank that waits least" if rank is not None else ""
    sharded = fsdp2 or comm_label("forward") in parts  # FSDP2 (its all-gathers wait in forward; DDP's never do)
    what = "FSDP2's all-gathers and reduce-scatters" if sharded else "the gradient all-reduce"
    why = (f"the step waits {wait_ms:.2f} ms for {what} it could not hide{who}: "
           f"{_pct(share)} of the step (exposed communication, {' + '.join(parts)})")
    tips: tuple[str, ...] = (
        "a larger batch per rank (or gradient accumulation with no_sync()): the same collectives hide behind "
        "more compute",)
    if sharded:
        tips += ("FSDP2: prefetch further ahead (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch); "
                 "reshard_after_forward=False (or an int) on the last blocks saves backward's re-gather",
                 "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) halves what the "
                 "all-gathers carry; HSDP (a 2-D mesh) keeps them within a node")
    else:
        tips += ("DDP(bucket_cap_mb=...): smaller buckets start the all-reduce earlier in backward, so less is left "
                 "after the last gradient; DDP(gradient_as_bucket_view=True) saves the copy into .grad that DDP "
                 "makes after each wait (backward's time, not the wait's); static_graph=True when the graph "
                 "does not change",
                 "compress what goes over the wire: ddp.register_comm_hook(state, bf16_compress_hook) (or fp16, or "
                 "PowerSGD for large models)",
                 "for a model too large for it, FSDP2 (fully_shard) with prefetching overlaps its collectives with "
                 "compute")
    return Diagnosis("COMM_BOUND", _severity(share), why, tips, ev)
