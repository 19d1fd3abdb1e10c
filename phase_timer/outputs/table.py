"""The end-of-training table, as text: the phases, the measures' lines, the memory block, phase-timer's own cost, the
census, the verdict and where the files went."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from phase_timer.diagnosis import format_verdict
from phase_timer.distributed.rank_view import format_rank_table
from phase_timer.phases import (BEFORE, BEFORE_NOTE, BETWEEN, BETWEEN_PREFIX, COMM_PARTS, HOST_PHASES, ordered,
                                 share_base)
from phase_timer.timing.stats import RunTotals

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
        of = totals.share(p)
        share = "" if of is None else f"{100 * of:5.1f}%"
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


def run_table(core: Any, title: str = "phase-timer") -> str:
    """A run's table (``TimingCore.summary_table``): the phases (and the ranks'), each measure's line in the order
    they listen, memory, own cost, the sync census, the verdict and the files."""
    ranks = core.ranks
    table = format_summary(core.totals, clock=core.clock.kind, untimed_reason=core.untimed_reason,
                           title=title if ranks is None else f"{title} (rank {ranks.rank})")
    if ranks is not None and ranks.totals is not None:
        table += "\n\n" + format_rank_table(ranks.totals, title=title)
    lines = [measure.line() for measure in core.measures if not measure.foot]
    memory = core.measure("memory")  # its block, under the measures' lines
    lines += [format_memory(memory.summary() if memory is not None else None), core.own_cost_line()]
    lines += [measure.line() for measure in core.measures if measure.foot]  # the sync census's
    if core.diagnosis is not None and (core.totals.steps or core.oom is not None):
        lines.append(format_verdict(core.diagnosis))
    lines.append(core.files_line())
    return table + "".join("\n" + line for line in lines if line)


def files_line(log_dir: str | None, missing: str | None, summary_path: str | None) -> str | None:
    """``files: TensorBoard values in <log_dir>; summary <path>`` (``missing``: why no values were written, where no
    ``log_dir``); None: no file."""
    parts = []
    if log_dir is not None:
        parts.append(f"TensorBoard values in {log_dir}")
    elif missing is not None:
        parts.append(missing)
    if summary_path is not None:
        parts.append(f"summary {summary_path}")
    return "files: " + "; ".join(parts) if parts else None
