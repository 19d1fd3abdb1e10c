"""The verdict: which bottleneck holds the run back, why, and what to try -- from the numbers we have.

Every rule reads signals the timer already collects (the run totals, the sampled
steps in flight and host step times, each window's spread, the ranks' windows, the
loader's settings) and adds no sync.  A rule whose signal is missing abstains: a
missing signal is never a zero.  The thresholds are the module's constants below;
``docs/diagnosis.md`` explains each.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from phase_timer import run_change
from phase_timer.cpu_use import CpuUse
from phase_timer.input_advice import Run, advise
from phase_timer.phases import COMM_PARTS, RANK_WAITS, TOTALS, comm_label, share_base
from phase_timer.memory import BEFORE, BEFORE_NOTE
from phase_timer.run_change import RankShifts
from phase_timer.syncs import SyncCensus, SyncSite

#: Fewer timed steps than this, and no other rule speaks.
MIN_STEPS = 20
#: A share of ``period`` (or of ``step`` for ``h2d``) at or above this is material ...
MATERIAL = 0.10
#: ... and at or above this, high.
HIGH = 0.30
#: Sampled steps needed before the host/device rules speak.
MIN_FLIGHT_SAMPLES = 4
#: HOST_BOUND: in at least this share of sampled steps the device had finished every earlier step ...
HOST_IDLE_SHARE = 0.5
#: ... and the device's step lasted less than this many times the host's time to issue it ...
PACED_RATIO = 1.25
#: ... and the device was more than a phase behind the host at fewer than this share of the sampled
#: steps' boundaries (at or above it the device is busy, even when the host is held to its pace).
#: Calibrated on an H100 against the device's busy share on the profiler's timeline (docs/diagnosis.md):
#: 0-30% in host-held runs (busy 0.45-0.66; the step's tail boundary alone reads ~10%), 44-100% in
#: GPU-bound ones (a sync mid-step on a busy GPU: 44-50%; the host far ahead: 100%).
BEHIND_SHARE = 0.35
#: UNSTABLE: a window is spiky when p90/p50 or max/p50 of ``step`` or ``period`` reach these ...
SPIKE_P90 = 1.5
SPIKE_MAX = 4.0
#: ... counting windows of at least this many steps; it fires when more than this share of them are,
SPIKY_SHARE = 0.5
#: with at least this many windows.
MIN_WINDOWS = 3
#: RANK_STRAGGLER: the same rank slowest in one phase in at least this share of the windows (and 3) ...
STRAGGLER_SHARE = 0.6
#: ... by at least this share of the window's median ``period`` (and 0.05 ms).
STRAGGLER_MARGIN = 0.05
#: The optimizer's share of ``step`` above which a fused optimizer is suggested.
OPTIMIZER_SHARE = 0.2
#: Phases in which the other ranks' wait for a slow one shows; they are never the straggler's.
WAIT_PHASES = RANK_WAITS | set(TOTALS)

#: Memory (CUDA; ``docs/diagnosis.md``).  MEMORY_PRESSURE: the peak reserved at or above this share of the
#: device's memory (high at PRESSURE_HIGH), or any allocation the allocator had to retry after freeing its cache.
PRESSURE_SHARE = 0.90
PRESSURE_HIGH = 0.95
#: MEMORY_HEADROOM: the peak reserved at or below this share of the device; the estimate fills FILL_SHARE of it.
HEADROOM_SHARE = 0.5
FILL_SHARE = 0.85
#: MEMORY_CREEP: allocated at the step's begin rises by at least CREEP_MIN_MB over at least CREEP_POINTS steady
#: samples, between at least CREEP_RISING of consecutive ones; high when the device would be full within
#: CREEP_HIGH_STEPS steps at that rate.
CREEP_MIN_MB = 64.0
CREEP_POINTS = 4
CREEP_RISING = 0.75
CREEP_HIGH_STEPS = 10_000
#: MEMORY_FRAGMENTATION: the peak reserved at or above FRAG_RATIO x the peak allocated, by FRAG_MIN_MB or more.
FRAG_RATIO = 1.3
FRAG_MIN_MB = 1024.0
#: MEMORY_RANK_IMBALANCE: the largest rank's peak allocated above the other ranks' median by this share and
#: IMBALANCE_MIN_MB.
IMBALANCE_SHARE = 0.1
IMBALANCE_MIN_MB = 512.0

#: OUT_OF_MEMORY (an out-of-memory error ended the run; ``phase_timer/oom.py`` says what was known): it came in
#: one of the first OOM_FIRST_STEPS steps begun (the first optimizer step makes the optimizer's state) ...
OOM_FIRST_STEPS = 2
#: ... activations are large at OOM_ACTIVATIONS of what the step wanted (allocated at the failure plus the request)
#: or of the peak allocated; the optimizer's state at OOM_OPTIMIZER of the device (or of what the step wanted);
#: the cache held in pieces when what was reserved but unallocated could have held the request (and OOM_FRAG_MIN_MB).
OOM_ACTIVATIONS = 0.3
OOM_OPTIMIZER = 0.25
OOM_FRAG_MIN_MB = 256.0
#: COMM_BOUND: the exposed communication's share of the step on the rank that waits least.
COMM_MATERIAL = 0.10

KINDS = (
    "TOO_FEW_STEPS", "INPUT_BOUND", "H2D_BOUND", "SYNC_WAIT", "RANK_STRAGGLER", "COMM_BOUND", "HOST_BOUND", "UNSTABLE",
    "RUN_CHANGED", "GPU_BOUND", "MEMORY_PRESSURE", "MEMORY_CREEP", "MEMORY_FRAGMENTATION", "MEMORY_RANK_IMBALANCE",
    "MEMORY_HEADROOM", "MFU_IMPOSSIBLE", "OUT_OF_MEMORY", "NO_FINDING",
)


@dataclass(frozen=True)
class Diagnosis:
    """A finding: its ``kind``, ``severity`` (``high``, ``medium``, ``info``), ``why``, ``next`` steps and ``evidence``.

    The primary finding also carries the other findings that fired, in order, as ``secondary``.
    """

    kind: str
    severity: str
    why: str
    next: tuple[str, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
    secondary: tuple[Diagnosis, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "severity": self.severity, "why": self.why, "next": list(self.next),
               "evidence": dict(self.evidence)}
        out["secondary"] = [d.as_dict() for d in self.secondary]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diagnosis:
        """The finding :meth:`as_dict` wrote (as the run summary file holds it)."""
        return cls(d["kind"], d["severity"], d["why"], tuple(d.get("next") or ()), dict(d.get("evidence") or {}),
                   tuple(cls.from_dict(s) for s in d.get("secondary") or ()))


class Signals:
    """What the rules read, gathered during the run (per window or on sampled steps, never per step)."""

    def __init__(self) -> None:
        #: Steps in flight at each sampled close (CUDA clock only): earlier steps the device had not finished.
        self.flight: Counter[int] = Counter()
        #: Of the sampled closes with none in flight, those at which the step just ended was still running too
        #: (evidence only: a host-bound loop with a heavy optimizer tail reads busy here too).
        self.tail_checked = 0
        self.tail_busy = 0
        #: At sampled steps' boundaries: how often the device had not yet begun the span the host had just
        #: issued (more than a phase behind the host inside the step), of the boundaries checked.
        self.behind_checked = 0
        self.behind = 0
        #: Sampled steps' host time from the step's begin to its end (ms), and phase-timer's own host time (ns,
        #: window ends out); and the own host time of the ordinary steps timed apart (``phase_timer.own_cost``).
        self.host_step_ms: list[float] = []
        self.own_ns: list[int] = []
        self.plain_ns: list[int] = []
        #: The sampled steps' mean gap once sparse (set by the boundaries): the own-cost line's long-run rate.
        self.sample_gap: float | None = None
        self.windows = 0
        self.spiky_windows = 0
        #: Per (phase, rank): windows in which the rank was slowest by a material margin, and the margins (ms).
        self.slowest: Counter[tuple[str, int]] = Counter()
        self.margins: dict[tuple[str, int], float] = {}
        self.rank_period_ms: list[float] = []
        #: The sync census of one warm-up step: its status ("done" or why not), the step, the syncs heard.
        self.census = "not run"
        self.census_step: int | None = None
        self.syncs: list[SyncSite] = []
        #: The model is sharded with FSDP2 (``fully_shard``): COMM_BOUND gives its advice (set by comm.py).
        self.fsdp2 = False
        self.sync_count = 0
        #: Syncs on that step that were no step's: other threads outside backward, pauses (evaluation, saves).
        self.sync_other_threads = 0
        self.sync_paused = 0
        #: The CPU time of the training process, its training thread and the loader's workers, read at a few
        #: window ends (``phase_timer.cpu_use``): what the INPUT_BOUND advice is made of.
        self.cpu = CpuUse()
        #: Each window's per-phase medians in step order (the core's ``stats.WindowSeries``) and, on rank zero
        #: of a distributed run, each window's slowest rank a phase: what RUN_CHANGED reads.
        self.series: Any = None
        self.rank_shifts = RankShifts()

    def add_census(self, census: SyncCensus, step: int) -> None:
        """What the census heard on warm-up step ``step``."""
        if census.status == "not run":
            self.census = "not run: the run ended before its last warm-up step"
            return
        self.census = census.status
        if census.status == "done":
            self.census_step, self.syncs, self.sync_count = step, list(census.sites), census.count
            self.sync_other_threads, self.sync_paused = census.other_threads, census.paused

    def add_window(self, steps: int, summary: dict[str, dict[str, float]]) -> None:
        """One window's statistics: is it spiky?"""
        if steps < 10:
            return
        self.windows += 1
        mean = (summary.get("period") or {}).get("mean")
        if mean is not None:
            self.cpu.add_window(steps, steps * mean)
        for total in ("step", "period"):
            s = summary.get(total)
            if s and s["p50"] > 0 and (s["p90"] / s["p50"] >= SPIKE_P90 or s["max"] / s["p50"] >= SPIKE_MAX):
                self.spiky_windows += 1
                return

    def add_rank_window(self, spreads: dict[str, Any], step: int | None = None) -> None:
        """One window across ranks (each phase's ``ranks.Spread``), ending at ``step``: which rank was slowest in
        each phase, by how much."""
        if step is not None:
            self.rank_shifts.add(step, spreads)
        scale_of = spreads.get("period") or spreads.get("step")
        if scale_of is None or scale_of.n < 2:
            return
        scale = scale_of.median()
        self.rank_period_ms.append(scale)
        for phase, spread in spreads.items():
            if phase in WAIT_PHASES or spread.n < 2:  # a rank's wait for the others is no lag
                continue
            slow = spread.hi_rank
            margin = spread.hi - spread.median_of_rest()
            if margin >= max(0.05, STRAGGLER_MARGIN * scale):
                self.slowest[phase, slow] += 1
                self.margins[phase, slow] = self.margins.get((phase, slow), 0.0) + margin


def phase_share(totals: Any, phase: str, base: str) -> float | None:
    p, b = totals.phases.get(phase), totals.phases.get(base)
    if p is None or b is None or b.total <= 0:
        return None
    return p.total / b.total


def _severity(share: float) -> str:
    return "high" if share >= HIGH else "medium"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(totals: Any, signals: Signals, *, clock: str, context: dict[str, Any] | None = None,
             rank_totals: Any = None, skipped: int = 0, warmup_steps: int | None = None,
             memory: dict[str, Any] | None = None, mfu: list[str] | None = None,
             oom: dict[str, Any] | None = None) -> Diagnosis:
    """The primary finding (with the others as ``secondary``) for a run's totals and signals.

    ``memory``: the memory summary (``TimingCore.memory_summary``); its findings come after the time ones,
    except a high one, which comes first.  ``mfu``: what MFU says (``mfu.mfu_advice``): a GPU-bound run's
    tips at low MFU, or that an MFU over 100% cannot be (``MFU_IMPOSSIBLE``).  ``oom``: what was known when an
    out-of-memory error ended the run (``TimingCore.oom``): ``OUT_OF_MEMORY`` then leads, whatever the number
    of steps, and the rest follows it."""
    found = _findings(totals, signals, clock=clock, context=context, rank_totals=rank_totals, skipped=skipped,
                      warmup_steps=warmup_steps, memory=memory, mfu=mfu)
    if not oom:
        return found
    rest = () if found.kind in ("NO_FINDING", "TOO_FEW_STEPS") else (replace(found, secondary=()),)
    return replace(out_of_memory(oom, memory), secondary=rest + found.secondary)


def _findings(totals: Any, signals: Signals, *, clock: str, context: dict[str, Any] | None,
              rank_totals: Any, skipped: int, warmup_steps: int | None, memory: dict[str, Any] | None,
              mfu: list[str] | None = None) -> Diagnosis:
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
        _input_bound(totals, signals, ctx), _h2d_bound(totals, ctx, clock), _sync_wait(totals),
        _straggler(signals, rank_totals), _comm_bound(totals, rank_totals, signals.fsdp2),
    ) if f is not None]
    found.sort(key=lambda f: -f.evidence["share_of_period"])
    host = _host_bound(totals, signals, clock)
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
        gpu = _gpu_bound(totals, signals, clock, ctx)
        if gpu is not None:
            found.append(gpu)
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


def _input_bound(totals: Any, signals: Signals, ctx: dict[str, Any]) -> Diagnosis | None:
    share = phase_share(totals, "data_wait", "period")
    if share is None or share < MATERIAL:
        return None
    wait = totals.phases["data_wait"]
    loader = ctx.get("loader")
    cores = ctx.get("cpu_count")
    cpu = signals.cpu.summary()
    run = Run(totals.phases["period"].mean, wait.mean, wait.quantile(50), cores, cpu)
    tips, found = advise(loader, run, ctx.get("device_type"))
    why = (f"the loop waits {wait.mean:.2f} ms a step for its next batch: {_pct(share)} of the time per step "
           "(data_wait of period)")
    ev = {"share_of_period": share, "data_wait_ms": wait.mean, "data_wait_p50_ms": run.wait_p50, "loader": loader,
          "cpu_count": cores, "cpu": cpu, **found}
    return Diagnosis("INPUT_BOUND", _severity(share), why, tuple(tips), ev)


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


def _straggler(signals: Signals, rank_totals: Any) -> Diagnosis | None:
    """RANK_STRAGGLER: one rank slowest in one phase in most windows, by a material margin over the other ranks'
    median; or, where the collectives equalise the steps and no phase shows it (or the others wait longer for
    another rank than that phase is slow), the rank the others wait for."""
    n = len(signals.rank_period_ms)  # the windows across ranks
    if n < 1:
        return None
    period = statistics.median(signals.rank_period_ms)
    found = None
    if signals.slowest:
        (phase, rank), count = max(signals.slowest.items(), key=lambda kv: (kv[1], signals.margins[kv[0]]))
        if count >= max(MIN_WINDOWS, STRAGGLER_SHARE * n):
            found = (phase, rank, signals.margins[phase, rank] / count, count)
    waited = _waited_for(rank_totals, period)
    if waited is not None and (found is None or waited[0] != found[1] and waited[1] > found[2]):
        return _straggler_by_waits(rank_totals, period, n, *waited)
    if found is None:
        return None
    phase, rank, margin, count = found
    share = margin / period if period > 0 else 0.0
    ev: dict[str, Any] = {"rank": rank, "phase": phase, "margin_ms": margin, "windows": count, "of_windows": n,
                          "share_of_period": share, "by": "phase"}
    why = (f"rank {rank} is the slowest in {phase} in {count} of {n} windows, {margin:.2f} ms a step above the "
           f"other ranks' median ({_pct(share)} of period)")
    tips = [_look_at(rank, phase)]
    if rank_totals is not None:
        split = bool(_parts(rank_totals))
        mine = _rank_wait(rank_totals, rank, split)
        if split and mine is None:  # a rank that never waited
            mine = 0.0
        others = [m for r in rank_totals.sums if r != rank and (m := _rank_wait(rank_totals, r, split)) is not None]
        if mine is not None and others:
            wait = statistics.median(others) - mine
            ev["others_backward_wait_ms"] = wait  # the name kept where the waits are split too: the extra wait
            if wait > 0 and split:
                ev["others_comm_wait_ms"] = statistics.median(others)
                tips.append(f"the other ranks wait {wait:.2f} ms a step longer than rank {rank} for their collectives "
                            f"(their exposed communication, {' + '.join(_parts(rank_totals))}): that is rank {rank}'s "
                            "lag reaching them, not the network")
            elif wait > 0:
                tips.append(f"the other ranks' backward is {wait:.2f} ms longer than rank {rank}'s: their wait for it "
                            "in the gradient all-reduce")
    return Diagnosis("RANK_STRAGGLER", "high" if share >= 0.2 else "medium", why, tuple(tips + _input_tip(phase)), ev)


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
    tips = []
    paused = _paused(rank_totals, rank)
    if paused is not None and paused[0] >= max(0.05, STRAGGLER_MARGIN * period):
        more, own, theirs, pauses, steps = paused
        ev.update(paused_ms_per_step=own, others_paused_ms_per_step=theirs, pauses=pauses)
        tips.append(f"rank {rank} pauses {own:.2f} ms a step on average outside its steps ({pauses} pauses over "
                    f"{steps} steps, one every ~{steps / pauses:.0f} steps: evaluation, checkpoints, logging), "
                    f"{more:.2f} ms more than the other ranks' median: each pause is their wait in their next "
                    "collective. Run that work on every rank at the same step (evaluation sharded across the ranks), "
                    "or outside training")
    if where:
        tips.append(f"rank {rank} spends {where[1]:.2f} ms a step more than the other ranks in {where[0]}: "
                    + _look_at(rank, where[0]))
    elif not tips:
        tips.append(f"no timed phase of rank {rank}'s is longer than the others': its lag is host work the device "
                    "does not see as a phase (Python between launches, logging, checkpoints or evaluation on that "
                    "rank alone); trace that rank (trace_steps=) to find it")
    return Diagnosis("RANK_STRAGGLER", "high" if share >= 0.2 else "medium", why,
                     tuple(tips + _input_tip(where[0] if where else None)), ev)


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


def _host_bound(totals: Any, signals: Signals, clock: str) -> Diagnosis | None:
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
    said = _syncs_said(signals)
    if said is None:
        tips.insert(0, "find host-device syncs inside the step: torch.cuda.set_sync_debug_mode('warn')")
    else:
        why += f"; {said[0]}"
        tips[:0] = said[1]
    ev = {"samples": n, "share_at_zero_in_flight": idle, "device_over_host_step": ratio,
          "host_step_ms": statistics.median(signals.host_step_ms), "tail_busy": signals.tail_busy,
          "tail_checked": signals.tail_checked, "behind": signals.behind, "behind_checked": signals.behind_checked,
          **_census_evidence(signals)}
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
    """RUN_CHANGED (``phase_timer.run_change``): a phase's level moved partway through the run and stayed."""
    if signals.series is None:
        return None
    scale = totals.phases.get("period") or totals.phases.get("step")
    found = run_change.finding(signals.series, scale.quantile(50) if scale is not None else None,
                               signals.rank_shifts if signals.rank_shifts.points else None)
    return Diagnosis("RUN_CHANGED", *found) if found is not None else None


def _gpu_bound(totals: Any, signals: Signals, clock: str, ctx: dict[str, Any]) -> Diagnosis | None:
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
    ev.update(_census_evidence(signals))
    if idle >= HOST_IDLE_SHARE:
        said = _syncs_said(signals)
        why += f"; but the host never got a step ahead in {_pct(idle)} of sampled steps: "
        if said is None:
            why += ("something waits for the GPU inside each step (.item(), .cpu(), printing a tensor), or the host "
                    "issues a step about as fast as the device runs it, so the host cannot queue ahead")
            tips.append("find a per-step sync with torch.cuda.set_sync_debug_mode('warn'); read values every N steps")
        else:
            why += said[0] + ("" if signals.syncs else ", so the host issues a step about as fast as the device "
                              "runs it (a full launch queue)")
            tips[:0] = said[1]
    return Diagnosis("GPU_BOUND", "info", why, tuple(tips), ev)


def _mfu_impossible(mfu: list[str]) -> Diagnosis | None:
    """An MFU over 100% (``mfu.mfu_advice`` says only that): the FLOP count or the peak is wrong."""
    if not mfu or not mfu[0].startswith("MFU over 100%"):
        return None
    return Diagnosis("MFU_IMPOSSIBLE", "medium", mfu[0].split(" cannot be")[0] + " cannot be right",
                     (mfu[0],), {})


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


def out_of_memory(oom: dict[str, Any], mem: dict[str, Any] | None) -> Diagnosis:
    """OUT_OF_MEMORY: where the run was when it ran out, what failed, what each phase held, and what to try,
    from what was measured (``oom``: ``phase_timer/oom.py``'s facts; ``mem``: the memory summary, or None)."""
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


def _stepping(site: SyncSite) -> bool:
    """A sync inside the step (not in the fetch, between steps, or in a pause)."""
    return share_base(site.phase) == "step"


def _syncs_said(signals: Signals) -> tuple[str, list[str]] | None:
    """What the census heard, for a verdict about a host that never gets ahead: a clause for ``why``, and
    what to try (each site's known cause first, then what is left when those are off).  None: no census."""
    if signals.census != "done":
        return None
    syncs = sorted(signals.syncs, key=lambda s: (not _stepping(s), -s.count))
    step = signals.census_step
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


def _census_evidence(signals: Signals) -> dict[str, Any]:
    return {"sync_census": signals.census, "syncs": [s.as_dict() for s in signals.syncs]}


def format_verdict(d: Diagnosis) -> str:
    """The verdict in a few lines: the kind and why, what to try, the other findings."""
    lines = [f"verdict: {d.kind} ({d.severity}): {d.why}"]
    lines += [f"  next: {tip}" for tip in d.next[:3]]
    if d.secondary:
        lines.append("  also: " + "; ".join(f"{s.kind} ({s.why.split(':')[0]})" for s in d.secondary))
    return "\n".join(lines)
