"""Names and order of what is measured, and how it is written down."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from phase_timer.memory import BEFORE, BEFORE_NOTE
from phase_timer.stats import WINDOW_STATS, RunTotals

if TYPE_CHECKING:
    from phase_timer.ranks import RankWindow

#: The device time from a step's end (its last optimizer step) to the next batch's fetch.
BETWEEN = "between_steps"
#: The label of spans that are nobody's time, never reported, and out of ``period``: evaluation and validation
#: inside a record.
PAUSED = "paused"
#: The label of the span of an accumulated step's fetch of its next micro-batch: no device phase's and not the
#: step's (the host's ``data_wait`` has it), but the period's.
FETCH = "data_wait"
#: Built-in phases inside a step.  After the step's end they fold into ``between_steps``.
STEP_PHASES = ("h2d", "forward", "backward", "optimizer", "idle")
#: Built-in phases in display order.  Custom phases (plain-PyTorch door) go after them.
PHASE_ORDER = ("data_wait", "sync_wait", *STEP_PHASES, BETWEEN)
#: Phases read on the host clock whatever the device.  (``period`` is on the marks' clock where a record follows
#: the one before it: ``resolver.resolve``.)
HOST_PHASES = frozenset({"data_wait", "sync_wait"})
#: Totals, shown last.
TOTALS = ("step", "period")
#: A custom phase's time after the step's end is named apart: ``between_steps.<name>``.  So a name says
#: whether its time is part of ``step`` (``clip``) or of the time between steps (``between_steps.ema``),
#: and each share is of the right total, in the run's own table as in a report read back from TensorBoard
#: alone.  An in-step phase keeps the user's name (its tag is the one the README shows); a user's name is an
#: identifier, so it never holds the dot, and no user phase can take a name made here.
BETWEEN_PREFIX = BETWEEN + "."
#: Names that are no custom phase: they keep their name after the step's end.
_NOT_CUSTOM = frozenset({BETWEEN, PAUSED, FETCH, *HOST_PHASES, *TOTALS})
#: Exposed communication: the part of a phase the compute stream spent waiting for collectives it could not
#: hide (DDP's all-reduce tail in ``backward``; FSDP2's all-gather waits in ``forward`` and ``backward``, its
#: reduce-scatter tail).  A span labelled ``<phase>.comm_wait`` is ``<phase>``'s time *and* its own row ("of
#: which"): the phases still add up to ``step``, and no share sums it twice (:func:`part_of`).
COMM_WAIT = "comm_wait"
COMM_PARTS = {f"{p}.{COMM_WAIT}": p for p in ("forward", "backward")}
#: Phases in which a rank waits for the others (a slow rank shows there on every other rank): never a rank's
#: own lag.
RANK_WAITS = frozenset({"backward", "sync_wait", *COMM_PARTS})


def comm_label(phase: str) -> str:
    """The label of ``phase``'s wait for collectives (``backward`` -> ``backward.comm_wait``)."""
    return f"{phase}.{COMM_WAIT}"


def part_of(phase: str) -> str | None:
    """The phase whose time ``phase`` is part of ("of which": ``backward.comm_wait`` -> ``backward``), or None.

    Both engines apply it: a span so labelled inside the step counts to its own row and to the whole's."""
    return COMM_PARTS.get(phase)


def after_end(phase: str) -> str:
    """The name of a span of ``phase`` after the step's end (between steps).

    Built-in step phases fold into ``between_steps``; a custom phase becomes ``between_steps.<phase>`` (one
    used both inside the step and after it, e.g. left open across ``optimizer.step()``, is two rows, each
    of its own total); anything else keeps its name.  Both engines apply this one rule: the Python one at
    each span, the C one once per name (``engine.native_steps``).
    """
    if phase in STEP_PHASES or phase in COMM_PARTS:
        return BETWEEN
    if phase in _NOT_CUSTOM or phase.startswith(BETWEEN_PREFIX):
        return phase
    return BETWEEN_PREFIX + phase


def share_base(phase: str) -> str | None:
    """What a phase's share is of: the step's phases (built-in and custom) of ``step``; the rest of ``period``.

    ``period`` is the time per step, and ``step`` the part of it from the batch in hand to the step's end;
    a custom phase inside the step is part of ``step``, one between steps (``between_steps.<name>``) is not.
    """
    if phase in TOTALS:
        return None
    if phase in STEP_PHASES or phase in COMM_PARTS or _in_step_custom(phase):
        return "step"
    return "period"


def _in_step_custom(phase: str) -> bool:
    return (phase not in PHASE_ORDER and phase not in _NOT_CUSTOM and not phase.startswith(BETWEEN_PREFIX)
            and phase not in COMM_PARTS)


def whole_phases(phases: Iterable[str]) -> list[str]:
    """``phases`` without the parts of another ("of which" rows): what adds up, what a share sum or a stack takes."""
    return [p for p in phases if p not in COMM_PARTS]


def share_note(clock: str | None = None, phases: Iterable[str] | None = None) -> str:
    """The footnote that says what the share column is, on this clock (``None``: not known).

    ``phases``: the table's, named under their base (``share: h2d, forward, ..., idle, clip of `step`;
    data_wait, between_steps, between_steps.ema of `period```); without them, what each base takes.
    """
    if phases is None:
        of_step = "h2d, forward, backward, optimizer, idle and custom phases inside the step"
        of_period = "the rest (data_wait, sync_wait, between_steps, custom phases after the step's end: " \
                    f"{BETWEEN_PREFIX}<name>)"
    else:
        shown = ordered(list(phases))
        of_step = ", ".join(p for p in shown if share_base(p) == "step") or "none"
        of_period = ", ".join(p for p in shown if share_base(p) == "period") or "none"
    step = "`step`" if clock in (None, "host") else "`step` (device clock)"
    note = f"share: {of_step} of {step}; {of_period} of `period`"
    if clock == "host":  # no device clock: each phase is host time (on a CPU, the work itself)
        note += ". All on the host clock: a phase is the host's time between its boundaries (on a CPU, the work itself)"
    return note

WINDOW_PREFIX = "phase_time"
STEP_PREFIX = "phase_time_step"
RANKS_PREFIX = "phase_time_ranks"
#: Across ranks, per phase, each rank's window mean: these, and which rank had the largest.
RANK_STATS = ("min", "median", "max", "slowest_rank")
RANKS_TAG = "phase_timer/ranks_reporting"
SKIPPED_TAG = "phase_timer/skipped_steps"
WINDOW_STEPS_TAG = "phase_timer/window_steps"
#: Per window: the mean over its sampled steps of the closed steps the device had not finished.
IN_FLIGHT_TAG = "phase_timer/steps_in_flight"
#: Memory (CUDA): a sampled step's allocator counters, at its own step (``phase_memory/<what>_mb``).
MEMORY_PREFIX = "phase_memory"
#: Across ranks, each rank's peak allocated (``phase_memory_ranks/peak_allocated_mb/{min,median,max,largest_rank}``).
MEMORY_RANKS_PREFIX = "phase_memory_ranks"
#: What a memory step writes, in display order: allocated at each boundary, then the run's peaks and the device.
MEMORY_ORDER = ("step_begin", "forward_begin", "backward_begin", "optimizer_begin", "idle_begin", "step_end",
                "activations", "reserved", "peak_allocated", "peak_reserved", "device_free")
#: Once, at the end: the verdict as text.
DIAGNOSIS_TAG = "phase_timer/diagnosis"


def ordered(phases: set[str] | list[str] | dict[str, Any]) -> list[str]:
    """The step's phases (built-ins in their order, then custom ones alphabetically), then the time between
    steps (``between_steps``, then custom phases after the step's end), then the totals; ``data_wait`` and
    ``sync_wait`` first."""
    present = set(phases)
    custom = sorted(present - set(PHASE_ORDER) - set(TOTALS) - set(COMM_PARTS))
    inside = [q for p in PHASE_ORDER if p in present and p != BETWEEN
              for q in (p, comm_label(p)) if q in present]  # a phase's "of which" row right under it
    inside += [p for p in custom if share_base(p) == "step"]
    between = [BETWEEN] if BETWEEN in present else []
    after = [p for p in custom if share_base(p) != "step"]
    return inside + between + after + [p for p in TOTALS if p in present]


def window_tag(phase: str, stat: str) -> str:
    return f"{WINDOW_PREFIX}/{phase}_ms/{stat}"


def step_tag(phase: str) -> str:
    return f"{STEP_PREFIX}/{phase}_ms"


def window_scalars(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flatten a window's statistics into ``{tag: value}``."""
    scalars = {}
    for p in ordered(list(summary)):
        stats = summary[p]
        for s, tag in _window_tags(p):
            scalars[tag] = stats[s]
    return scalars


@functools.lru_cache(maxsize=256)
def _window_tags(phase: str) -> tuple[tuple[str, str], ...]:
    """(stat, tag) of a phase's window statistics: made once, not at every window."""
    return tuple((s, window_tag(phase, s)) for s in WINDOW_STATS)


def rank_tag(phase: str, stat: str) -> str:
    return f"{RANKS_PREFIX}/{phase}_ms/{stat}"


def rank_scalars(window: RankWindow) -> dict[str, float]:
    """One window across ranks as ``{tag: value}``."""
    out = {rank_tag(p, s): v for p in ordered(list(window.phases)) for s, v in window.stats(p).items()}
    out[RANKS_TAG] = float(window.ranks)
    peaks = window.peak_mb
    if peaks is not None and peaks.n >= 2:
        for stat, v in (("min", peaks.lo), ("median", peaks.median()), ("max", peaks.hi),
                        ("largest_rank", float(peaks.hi_rank))):
            out[f"{MEMORY_RANKS_PREFIX}/peak_allocated_mb/{stat}"] = v
    return out


def step_scalars(ms: dict[str, float]) -> dict[str, float]:
    return {step_tag(p): ms[p] for p in ordered(list(ms))}


def memory_tag(what: str) -> str:
    return f"{MEMORY_PREFIX}/{what}_mb"


def memory_scalars(mb: dict[str, float]) -> dict[str, float]:
    """A memory step's values (MB) as ``{tag: value}``."""
    return {memory_tag(k): mb[k] for k in (*MEMORY_ORDER, *sorted(set(mb) - set(MEMORY_ORDER))) if k in mb}


def custom_scalars_layout(per_step: bool, ranks: bool = False) -> dict[str, dict[str, list]]:
    """A TensorBoard custom-scalars layout: every phase of one statistic in one chart."""
    charts: dict[str, list] = {
        f"{stat} per phase (ms)": ["Multiline", [rf"^{WINDOW_PREFIX}/.*_ms/{stat}$"]] for stat in WINDOW_STATS
    }
    if per_step:
        charts["every step (ms)"] = ["Multiline", [rf"^{STEP_PREFIX}/.*_ms$"]]
    charts["memory: allocated at each boundary (MB)"] = ["Multiline", [rf"^{MEMORY_PREFIX}/.*_(begin|end)_mb$"]]
    charts["memory: activations, peaks, reserved (MB)"] = [
        "Multiline", [rf"^{MEMORY_PREFIX}/(activations|reserved|peak_allocated|peak_reserved)_mb$"]]
    layout = {"phase-timer": charts}
    if ranks:  # one chart per built-in phase: its min, median and max across ranks
        layout["phase-timer across ranks"] = {
            f"{phase} across ranks (ms)": ["Multiline", [rf"^{RANKS_PREFIX}/{phase}_ms/(min|median|max)$"]]
            for phase in (*PHASE_ORDER, *TOTALS)
        }
        layout["phase-timer across ranks"]["slowest rank per phase"] = ["Multiline", [rf"^{RANKS_PREFIX}/.*_ms/slowest_rank$"]]
    return layout


def format_summary(totals: RunTotals, *, clock: str, title: str = "phase-timer", untimed_reason: str | None = None) -> str:
    """The end-of-training table: per phase mean, p50, p90, max and share.

    The step's phases (built-in and custom) show their share of ``step``, the rest of ``period``
    (:func:`share_base`; total over total).  Percentiles are within 0.5% (1%-wide histogram buckets).
    """
    phases = ordered(list(totals.phases))
    if not phases:
        return f"{title}: no step was timed: {untimed_reason or 'no step ended'}"
    head = ("phase", "clock", "mean ms", "p50 ms", "p90 ms", "max ms", "share")
    rows = []
    for p in phases:
        t = totals.phases[p]
        base_name = share_base(p)
        base = totals.phases.get(base_name) if base_name is not None else None
        # time-weighted: a phase absent from some steps (idle, a custom phase) is not overstated
        share = "" if base is None or base.total <= 0 else f"{100 * t.total / base.total:5.1f}%"
        if p == "step":
            share = "100.0%"
        row_clock = "host" if p in HOST_PHASES else clock
        name = f"  of which {p.rsplit('.', 1)[1].replace('_', ' ')}" if p in COMM_PARTS else p  # "of which comm wait"
        rows.append((name, row_clock, f"{t.mean:.3f}", f"{t.quantile(50):.3f}", f"{t.quantile(90):.3f}", f"{t.max:.3f}", share))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    rule = "-" * len(line(head))
    body = "\n".join(line(r) for r in rows)
    note = share_note(clock, totals.phases) + _between_note(totals)
    return f"{title}: {totals.steps} steps timed\n{rule}\n{line(head)}\n{rule}\n{body}\n{rule}\n{note}"


def _between_note(totals: RunTotals) -> str:
    """A line naming the time between steps, when it is a material part of ``period`` (>= 10%)."""
    between, period = totals.phases.get(BETWEEN), totals.phases.get("period")
    if between is None or period is None or period.total <= 0 or between.total < 0.1 * period.total:
        return ""
    return (
        f"\nbetween_steps: {between.mean:.3f} ms a step ({100 * between.total / period.total:.0f}% of period) from the "
        "optimizer step's end to the next batch's fetch: what runs there (schedulers, EMA, callbacks, logging, "
        "checkpoints), or the device waiting for it"
    )


def _mb(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1024:.2f} GiB" if abs(v) >= 1024 else f"{v:.0f} MiB"


def format_memory(mem: dict | None) -> str | None:
    """The memory block under the time table: allocated at each boundary, activations, the peaks and where.

    None when memory was not read (the host clock, ``memory=False``) or no memory step closed.
    """
    if not mem or not mem.get("samples"):
        return None
    alloc = mem.get("allocated_mb") or {}
    parts = []
    for key, name in (("step_begin", "step begin"), ("forward_begin", "forward"), ("backward_begin", "backward"),
                      ("optimizer_begin", "optimizer"), ("step_end", "step end")):
        s = alloc.get(key)
        if s:
            parts.append(f"{name} {_mb(s['mean'])}")
    lines = [f"memory (allocated when each begins, mean of {mem.get('steady_samples', 0)} sampled steps): "
             + (", ".join(parts) or "no steady sample yet")]
    act = alloc.get("activations")
    if act:
        lines.append(f"  activations (backward's begin - forward's): {_mb(act['mean'])} (max {_mb(act['max'])})")
    total = mem.get("device_total_mb")
    share = f" ({100 * mem['peak_reserved_mb'] / total:.0f}% of the device's {_mb(total)})" if total and mem.get(
        "peak_reserved_mb") is not None else ""
    where = mem.get("peak_phase")
    at = f" in {where}" + (f" (step {mem['peak_step']})" if mem.get("peak_step") is not None else "") if where else ""
    if where == BEFORE:  # the process's peak, not this run's
        at = f", {BEFORE_NOTE}"
    lines.append(f"  peak allocated {_mb(mem.get('peak_allocated_mb'))}{at}; peak reserved "
                 f"{_mb(mem.get('peak_reserved_mb'))}{share}")
    reached = _phase_peaks(mem)
    if reached:
        lines.append(f"  the highest each phase reached (where the peak counter rose in it): {reached}")
    creep = mem.get("creep")
    if creep and creep["points"] >= 3:
        lines.append(f"  allocated at step begin: {creep['mb_per_step']:+.2f} MB/step over steps "
                     f"{creep['from_step']}..{creep['to_step']} ({creep['points']} samples)")
    if mem.get("stopped"):
        lines.append(f"  memory stopped being read mid-run ({mem['stopped']}): the figures are those read before")
    if mem.get("alloc_retries"):
        lines.append(f"  the allocator freed its cache and retried {mem['alloc_retries']} allocation(s): "
                     "each is a device-wide sync")
    return "\n".join(lines)


#: Phases named on the memory block's line of each phase's highest (the highest first).
PHASE_PEAKS_SHOWN = 5


def _phase_peaks(mem: dict) -> str:
    """"backward 2.07 GiB (the peak), forward 1.07 GiB" from ``phase_peaks_mb`` (empty: none, or an older file)."""
    peaks = mem.get("phase_peaks_mb") or {}
    top = sorted(peaks.items(), key=lambda kv: -kv[1])[:PHASE_PEAKS_SHOWN]
    return ", ".join(f"{phase} {_mb(mb)}" + (" (the peak)" if phase == mem.get("peak_phase") else "")
                     for phase, mb in top)


def format_own_cost(own: dict) -> str:
    """"phase-timer's own host time: ≈X µs/step (Y% of period): ordinary steps A µs (...); window ends W, the
    verdict's sampled steps S and memory reads M µs/step amortized over N steps" (+ why it may be hidden), from
    ``TimingCore.own_cost()`` or a summary file's ``own_cost`` (one from before the ordinary steps were
    measured says what it held: the sampled steps' mean)."""
    us, share = own["us_per_step"], own.get("share_of_period")
    pct = f" ({100 * share:.2f}% of period)" if share is not None else ""
    if "ordinary_samples" not in own:
        line = f"phase-timer's own host time: {us:.1f} µs/step{pct}, sampled on {own['samples']} steps"
    else:
        line = f"phase-timer's own host time: ≈{us:.1f} µs/step{pct}: {_own_parts(own)}"
    if own.get("host_ahead"):
        line += ("; the host runs ahead of the device, so this time is hidden behind the device's work (it "
                 "includes waits in the driver's full launch queue, which the next launch would make anyway)")
    return line


def _own_parts(own: dict) -> str:
    ordinary, steps = own.get("ordinary_us"), own["steps"]
    if ordinary is not None:
        text = f"ordinary steps {ordinary:.1f} µs (median of {own['ordinary_samples']} timed apart)"
        amortized = [f"the verdict's sampled steps {own['sampling_us_per_step']:.1f}"]
    else:  # none timed: the sampled steps stand for one
        text = (f"{own['sampled_us']:.1f} µs on the verdict's {own['samples']} sampled steps, which do extra work "
                "(an upper bound: no ordinary step was timed)")
        amortized = []
    amortized.insert(0, f"window ends {own.get('windows_us_per_step') or 0.0:.1f}")
    if own.get("memory_us_per_step") is not None:
        amortized.append(f"memory reads {own['memory_us_per_step']:.1f}")
    text += f"; {', '.join(amortized[:-1])} and {amortized[-1]} µs/step amortized over {steps} steps"
    long_run, us = own.get("long_run_us_per_step"), own["us_per_step"]
    if long_run is not None and long_run < us - max(1.0, 0.1 * us):
        text += f" (≈{long_run:.1f} µs/step over a long run: the first steps are sampled densely)"
    return text
