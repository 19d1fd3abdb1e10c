"""``phase-timer report``: phase-timer's TensorBoard scalars as tables, JSON or a figure.

Usage::

    phase-timer report LOGDIR [LOGDIR ...] [--json] [--png FILE] [--source auto|window|step]
    python -m phase_timer.report LOGDIR [LOGDIR ...] [...]     # the same, without the word `report`

A LOGDIR is a run directory (event files directly in it) or any directory above
runs: every directory under it whose event files hold ``phase_time/`` scalars is
one run.  Files are read with TensorBoard's own ``EventAccumulator``.

Where the numbers come from (``source``):

``step``
    The run was logged with ``per_step=True``: statistics are exact, over every
    timed step's ``phase_time_step/<phase>_ms`` value (``auto`` prefers this).
``window``
    Only the per-window summaries ``phase_time/<phase>_ms/<stat>`` exist, and a
    window's step count is not logged, so the columns are summaries of
    summaries: mean = mean of window means (every window weighs the same),
    p50 = median of window p50, p90 = max of window p90, max = max of window
    max.  ``steps`` is then unknown (``null``).

``share`` is a phase's part of the time per step: the step's phases, built-in and
custom (``timer.phase("clip")`` inside the step), of ``step`` (total phase time over
total step time for ``step``; mean of window means over the same for ``window``), so
that they sum to 1; ``data_wait``, ``sync_wait``, ``between_steps`` and custom phases
after the step's end (``between_steps.<name>``) of ``period``
(:func:`phase_timer.phases.share_base`); ``step`` 1.0 and ``period`` ``null``.

``--json`` prints, instead of the tables::

    {"runs": [{"run": "<run directory>",
               "source": "window" | "step",
               "steps": <timed steps (int) or null for "window">,
               "windows": <logging windows (int)>,
               "skipped_steps": <steps left untimed by max_pending (int)>,
               "phases": {"<phase>": {"mean_ms": float, "p50_ms": float, "p90_ms": float,
                                      "max_ms": float, "share": float | null}},
               "memory": {...} | null,
               "throughput": {...} | null,
               "flops": {...} | null}]}

Phases appear in :func:`phase_timer.phases.ordered` order.  ``--png FILE`` also
writes a figure: phase shares of the step per run (left) and each phase's window
mean over the steps (right, one row per run).

Memory (CUDA runs).  A run with memory data gets a memory block under its
table: from its summary file, the block the run printed
(:func:`phase_timer.table.format_memory`); from TensorBoard alone, a shorter one from
the ``phase_memory/*`` scalars (the last peaks, the mean allocated at the step's begin
and activations).  ``memory`` in ``--json`` is the summary file's ``memory`` object as
it is there, or for a TensorBoard-only run the same names that TensorBoard has
(``source``: ``"tensorboard"``, ``samples``, ``steady_samples``, ``allocated_mb``,
``peak_allocated_mb``, ``peak_reserved_mb``); ``null`` where memory was not read (a CPU,
the host clock, ``memory=False``): absent, not zero.  The figure gets a memory panel
(allocated at the step's begin, activations and the peak over the steps) when a run has
memory data; without any it is as it was.

Throughput and MFU.  A run whose batches were counted gets the line it printed,
``throughput: 36.9k tokens/s, 288.0 samples/s, 3.0 steps/s`` (and the job's, across ranks),
and from a version-6 summary file with FLOPs a ``FLOPs:`` line (a step's, forward and backward,
counted or given; TFLOP/s) and the MFU line with its denominator, ``MFU 41% of 989 TFLOP/s
(bf16 dense, H100 SXM): forward 52%, backward 47%`` (:func:`phase_timer.mfu.format_mfu`), or
the file's note on why there is none.  ``throughput`` and ``flops`` in ``--json`` are the
summary file's objects as they are there; for a run without one, what its TensorBoard
``throughput/*`` windows give (``source``: ``"tensorboard"``; each rate the windows' weighted by
their period, i.e. the run's total count over its total period; ``flops`` then has
``tflops_per_s`` and ``mfu`` only).  The figure gets a throughput panel (tokens/s, else
samples/s, over the run; from TensorBoard's windows, else from the summary file's window batches
where every step had the same count) and, beside it, MFU over the run (step, forward,
backward) when a run has it.

Exit status: 0 on success; 2 on a usage error or a log directory that does not
exist, holds no event files, holds no phase-timer scalars or holds a corrupt
event file (one line on stderr names the path).  A corrupt file is one whose
record framing breaks (a record header failing its checksum); a last record cut
short, as a run still writing leaves it, is not an error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phase_timer import throughput_report as rates
from phase_timer.phases import STEP_PHASES, TOTALS, ordered, share_base
from phase_timer.table import _mb, format_memory, format_own_cost, share_note
from phase_timer.tags import MEMORY_PREFIX, STEP_PREFIX, WINDOW_PREFIX
from phase_timer.run_summary import FILE_NAME
from phase_timer.runs import (
    PROG,
    PhaseScalars,
    Points,
    ReportError,
    check_event_file,
    read_phase_scalars,
    read_summary,
    require,
    run_command,
    run_dirs,
    tensorboard_flops,
    tensorboard_memory,
    tensorboard_throughput,
)
from phase_timer.stats import WINDOW_STATS, percentile

_STAT_KEYS = ("mean_ms", "p50_ms", "p90_ms", "max_ms")
#: What ``--json`` copies from a run summary file as it is there.
_SUMMARY_KEYS = ("interrupted", "steps_in_flight", "own_cost", "diagnosis")

@dataclass
class PhaseStats:
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None
    share: float | None = None
    #: From a run summary file only.
    p99_ms: float | None = None


@dataclass
class RunReport:
    run: str
    source: str  # "window" | "step"
    steps: int | None
    windows: int
    skipped_steps: int
    phases: dict[str, PhaseStats]
    #: Window mean of each phase at each window's last step (what the figure draws).
    timeline: dict[str, Points] = field(default_factory=dict)
    #: The clock of the step's phases ("cuda", "host"), where known (from a run summary file).
    clock: str | None = None
    #: The run summary file's content (``source == "summary"``).
    summary: dict[str, Any] | None = None
    #: The summary file's ``memory`` object, or :func:`~phase_timer.runs.tensorboard_memory`'s; None: not read.
    memory: dict[str, Any] | None = None
    #: What the figure's memory panel draws (MB): ``step_begin``, ``activations``, ``peak_allocated`` points.
    memory_timeline: dict[str, Points] = field(default_factory=dict)
    #: Where ``memory_timeline`` came from: "TensorBoard" or the summary file's name (None: no memory data).
    memory_from: str | None = None
    #: The summary file's ``throughput`` object, or TensorBoard's (:func:`~phase_timer.runs.tensorboard_throughput`);
    #: None: no batch was counted.
    throughput: dict[str, Any] | None = None
    #: The summary file's ``flops`` object (version 6), or what TensorBoard has of it; None: none.
    flops: dict[str, Any] | None = None
    #: What the figure's throughput panel draws (:func:`~phase_timer.throughput_report.timeline`) and its source.
    rate_timeline: dict[str, Points] = field(default_factory=dict)
    rate_from: str | None = None


def load_runs(logdirs: Sequence[str], source: str = "auto") -> list[RunReport]:
    """One report per phase-timer run found under the log dirs, in the order given."""
    reports: list[RunReport] = []
    seen: set[str] = set()
    for logdir in logdirs:
        found = 0
        for run_dir, (files, summary_path) in run_dirs(logdir).items():
            for path in files:
                check_event_file(path)
            key = os.path.realpath(run_dir)
            scalars = read_phase_scalars(run_dir) if files else PhaseScalars()
            use_summary = summary_path is not None and source in ("auto", "summary")
            if scalars.empty and not use_summary:
                continue
            found += 1
            if key in seen:
                continue
            seen.add(key)
            if use_summary:
                reports.append(summary_report(run_dir, read_summary(summary_path), scalars))
            elif source == "summary":
                raise ReportError(f"{run_dir}: no {FILE_NAME} (a run from before phase-timer wrote one: use --source auto)")
            else:
                report = build_report(run_dir, scalars, source)
                if summary_path is not None and report.throughput:  # there, but not read (--source window/step)
                    report.throughput["summary_skipped"] = True
                reports.append(report)
        if not found:
            raise ReportError(f"{logdir}: event files hold no phase-timer scalars ({WINDOW_PREFIX}/...)")
    return reports


# -- statistics ------------------------------------------------------------------------
def _values(points: Points | None) -> list[float]:
    return [v for _, v in points or []]


def window_stats(stats: dict[str, Points]) -> PhaseStats:
    """Summaries of a phase's window summaries (see the module docstring)."""
    means, p50s, p90s, maxes = (_values(stats.get(s)) for s in WINDOW_STATS)
    return PhaseStats(
        mean_ms=statistics.fmean(means) if means else None,
        p50_ms=statistics.median(p50s) if p50s else None,
        p90_ms=max(p90s) if p90s else None,
        max_ms=max(maxes) if maxes else None,
    )


def step_stats(points: Points) -> PhaseStats:
    """Exact statistics over every step's value."""
    values = sorted(_values(points))
    return PhaseStats(
        mean_ms=statistics.fmean(values),
        p50_ms=percentile(values, 50),
        p90_ms=percentile(values, 90),
        max_ms=values[-1],
    )


def window_share(phase: str, phases: dict[str, PhaseStats]) -> float | None:
    if phase == "step":
        return 1.0
    base = phases.get(share_base(phase) or "")
    mean = phases[phase].mean_ms
    if base is None or base.mean_ms is None or mean is None or base.mean_ms <= 0:
        return None
    return mean / base.mean_ms


def step_share(phase: str, step: dict[str, Points]) -> float | None:
    """Total time of ``phase`` over total time of its base, over the steps that have the base."""
    if phase == "step":
        return 1.0
    base_name = share_base(phase)
    if base_name is None or base_name not in step:
        return None
    base = dict(step[base_name])
    values = dict(step[phase])
    total = sum(base.values())
    if total <= 0:
        return None
    return sum(values.get(s, 0.0) for s in base) / total


def build_report(run_dir: str, scalars: PhaseScalars, source: str = "auto") -> RunReport:
    """Pick the source (``auto``: per-step values when there are any) and summarize."""
    use_step = bool(scalars.step) if source == "auto" else source == "step"
    if use_step and not scalars.step:
        raise ReportError(f"{run_dir}: no per-step scalars ({STEP_PREFIX}/...); the run was not logged with per_step=True")
    if not use_step and not scalars.window:
        raise ReportError(f"{run_dir}: no window scalars ({WINDOW_PREFIX}/...)")
    if use_step:
        phases = {p: step_stats(scalars.step[p]) for p in ordered(list(scalars.step))}
        for p, st in phases.items():
            st.share = step_share(p, scalars.step)
        steps: int | None = len({s for pts in scalars.step.values() for s, _ in pts})
    else:
        phases = {p: window_stats(scalars.window[p]) for p in ordered(list(scalars.window))}
        for p, st in phases.items():
            st.share = window_share(p, phases)
        steps = None
    return RunReport(
        run=run_dir,
        source="step" if use_step else "window",
        steps=steps,
        windows=_window_count(scalars),
        skipped_steps=int(max(_values(scalars.skipped), default=0)),
        phases=phases,
        timeline=_timeline(scalars),
        memory=tensorboard_memory(scalars),
        **_memory_timeline(scalars, None),
        throughput=tensorboard_throughput(scalars),
        flops=tensorboard_flops(scalars),
        **_rate_timeline(scalars, None),
    )


def summary_report(run_dir: str, data: dict[str, Any], scalars: PhaseScalars) -> RunReport:
    """A run from its summary file: the run's own statistics over every timed step, and its verdict."""
    phases = {}
    rows = data.get("phases") or {}
    for p in ordered(list(rows)):
        r = rows[p]
        phases[p] = PhaseStats(r.get("mean_ms"), r.get("p50_ms"), r.get("p90_ms"), r.get("max_ms"),
                               1.0 if p == "step" else r.get("share"), p99_ms=r.get("p99_ms"))
    steps = data.get("steps") or {}
    windows = data.get("windows") or {}
    if scalars.empty:  # no TensorBoard files: the summary's own window columns draw the figure
        last = windows.get("last_step") or []
        timeline = {p: [(s, v) for s, v in zip(last, cols.get("mean_ms") or []) if v is not None]
                    for p, cols in (windows.get("phases") or {}).items()}
        timeline = {p: timeline[p] for p in ordered(list(timeline))}
        n_windows = len(last) * int(windows.get("windows_per_batch") or 1)
    else:
        timeline, n_windows = _timeline(scalars), _window_count(scalars)
    return RunReport(
        run=run_dir, source="summary", steps=steps.get("timed"), windows=n_windows,
        skipped_steps=int(steps.get("skipped") or 0), phases=phases, timeline=timeline,
        clock=(data.get("environment") or {}).get("clock"), summary=data,
        memory=data.get("memory"), **_memory_timeline(scalars, data.get("memory")),
        throughput=data.get("throughput"), flops=data.get("flops"), **_rate_timeline(scalars, data),
    )


def _rate_timeline(scalars: PhaseScalars, data: dict[str, Any] | None) -> dict[str, Any]:
    points, source = rates.timeline(scalars, data)
    return {"rate_timeline": points, "rate_from": source}


def summary_lines(data: dict[str, Any]) -> list[str]:
    """What a summary file adds below the table: steps in flight, phase-timer's own cost, the syncs, the verdict."""
    from phase_timer.diagnosis import Diagnosis, format_verdict
    from phase_timer.rank_view import summary_table
    from phase_timer.syncs import SyncSite, format_census

    lines = []
    if data.get("interrupted"):
        lines.append("the run was interrupted: these numbers cover the steps timed before that")
    flight = data.get("steps_in_flight")
    if flight:
        ahead = "the host ran ahead of the GPU" if flight["median"] >= 1 else "the GPU mostly caught up at each step's end"
        lines.append(f"steps in flight: median {flight['median']:g}, mean {flight['mean']:.1f}, over "
                     f"{flight['samples']} sampled step ends ({ahead})")
    own = data.get("own_cost")
    if own:
        lines.append(format_own_cost(own))
    syncs = data.get("syncs")  # version 3
    census = syncs and format_census(syncs["census"], syncs.get("step"), [SyncSite.from_dict(d) for d in syncs["sites"]],
                                     syncs["count"], syncs.get("paused", 0))
    if census:
        lines.append(census)
    ranks = summary_table(data.get("ranks"))  # every rank's means (distributed runs)
    if ranks:
        lines.append(ranks)
    if data.get("diagnosis"):
        lines.append(format_verdict(Diagnosis.from_dict(data["diagnosis"])))
    return lines


def _window_count(scalars: PhaseScalars) -> int:
    return len({s for stats in scalars.window.values() for s, _ in stats.get("mean", [])})


def _timeline(scalars: PhaseScalars) -> dict[str, Points]:
    if scalars.window:
        return {p: scalars.window[p].get("mean", []) for p in ordered(list(scalars.window))}
    return {p: scalars.step[p] for p in ordered(list(scalars.step))}


#: What the memory panel draws, from the ``phase_memory/<what>_mb`` points.
_MEMORY_LINES = ("step_begin", "activations", "peak_allocated")


def _memory_timeline(scalars: PhaseScalars, memory: dict[str, Any] | None) -> dict[str, Any]:
    """:class:`RunReport`'s ``memory_timeline`` and ``memory_from``: every memory step's points from TensorBoard,
    else the summary file's steady samples of the step's begin, with the run's peak and mean activations drawn flat
    over their span."""
    if scalars.memory.get("step_begin"):
        lines = {k: scalars.memory[k] for k in _MEMORY_LINES if scalars.memory.get(k)}
        return {"memory_timeline": lines, "memory_from": "TensorBoard"}
    points = [(int(s), float(v)) for s, v in (memory or {}).get("step_begin_points") or []]
    if not points:
        return {}
    return {"memory_timeline": _summary_memory_lines(points, memory or {}), "memory_from": FILE_NAME}


def _summary_memory_lines(points: Points, memory: dict[str, Any]) -> dict[str, Points]:
    span = [points[0][0], points[-1][0]]
    out = {"step_begin": points}
    act = (memory.get("allocated_mb") or {}).get("activations")
    if act:
        out["activations"] = [(s, act["mean"]) for s in span]
    if memory.get("peak_allocated_mb") is not None:
        out["peak_allocated"] = [(s, memory["peak_allocated_mb"]) for s in span]
    return out


# -- output: tables, JSON --------------------------------------------------------------
_HEADERS = {
    "summary": ("mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms"),
    "step": ("mean ms", "p50 ms", "p90 ms", "max ms"),
    "window": (
        "mean ms\n(mean of\nwindow means)",
        "p50 ms\n(median of\nwindow p50)",
        "p90 ms\n(max of\nwindow p90)",
        "max ms\n(max of\nwindow max)",
    ),
}


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def _describe(report: RunReport) -> str:
    if report.source == "summary":
        steps = (report.summary or {}).get("steps") or {}
        what = (f"{report.steps} steps timed, {report.skipped_steps} skipped (max_pending), {steps.get('warmup', 0)} "
                f"warm-up; the run's own statistics over every timed step, from its {FILE_NAME} "
                "(percentiles within 0.5%)")
        if report.clock:
            what += f"; the step's phases on the {report.clock} clock"
    elif report.source == "step":
        what = f"{report.steps} steps timed; exact statistics over per-step values"
    else:
        what = f"{report.windows} logging windows; summaries of the window summaries (per-step values not logged)"
    if report.skipped_steps:
        what += f"; {report.skipped_steps} steps skipped (max_pending) and not in these numbers"
    return f"run: {report.run}\n{what}"


def format_run(report: RunReport) -> str:
    """One run's table: phase, four statistics in ms, share."""
    from tabulate import tabulate

    exact = report.source == "summary"
    rows = [
        (p, _ms(s.mean_ms), _ms(s.p50_ms), _ms(s.p90_ms), *((_ms(s.p99_ms),) if exact else ()), _ms(s.max_ms),
         _pct(s.share))
        for p, s in report.phases.items()
    ]
    headers = ("phase", *_HEADERS[report.source], "share")
    table = tabulate(rows, headers=headers, disable_numparse=True, colalign=("left",) + ("right",) * (len(headers) - 1))
    extra = summary_lines(report.summary) if report.summary is not None else []
    memory = memory_block(report.memory)
    # In the run's own order: its rates and MFU, then memory, then the rest.
    return "\n".join([_describe(report), table, share_note(report.clock, report.phases),
                      *rates.run_lines(report.throughput, report.flops), *([memory] if memory else []), *extra])


def has_memory(memory: dict[str, Any] | None) -> bool:
    """Memory was read and at least one memory step closed (``memory`` may be a summary file's or TensorBoard's)."""
    return bool(memory and memory.get("samples") and memory.get("peak_allocated_mb") is not None)


def memory_block(memory: dict[str, Any] | None) -> str | None:
    """The run's memory block: the summary file's as the run printed it, else TensorBoard's; None: no memory data."""
    if memory is None or not has_memory(memory):
        return None  # memory not read (a CPU, the host clock, memory=False): absent, so nothing is printed
    if memory.get("source") != "tensorboard":
        return format_memory(memory)
    alloc = memory.get("allocated_mb") or {}
    names = (("step_begin", "at the step's begin"), ("activations", "activations"))
    means = ", ".join(f"{name} {_mb(alloc[k]['mean'])}" for k, name in names if alloc.get(k))
    peaks = (f"peak allocated {_mb(memory.get('peak_allocated_mb'))}, "
             f"peak reserved {_mb(memory.get('peak_reserved_mb'))}")
    return (f"memory (from TensorBoard's {MEMORY_PREFIX}/* scalars, {memory['samples']} sampled steps; no "
            f"{FILE_NAME}): allocated {means or 'not logged'} (mean of {memory['steady_samples']}); "
            f"{peaks} (last values)")


def run_labels(reports: Sequence[RunReport]) -> list[str]:
    """Short names: each run's path below the runs' common parent."""
    paths = [os.path.abspath(r.run) for r in reports]
    if len(paths) < 2:
        return [os.path.join(*p.split(os.sep)[-2:]) for p in paths]
    common = os.path.commonpath(paths)
    return [os.path.relpath(p, common) if p != common else os.path.basename(p) for p in paths]


def _mean_and_share(stats: PhaseStats | None) -> str:
    if stats is None:
        return ""
    return _ms(stats.mean_ms) + ("" if stats.share is None else f" ({_pct(stats.share)})")


def format_comparison(reports: Sequence[RunReport]) -> str:
    """Runs side by side: each phase's mean ms (share) per run."""
    from tabulate import tabulate

    labels = run_labels(reports)
    phases = ordered({p for r in reports for p in r.phases})
    rows = [("source", *(r.source for r in reports))]
    rows += [(p, *(_mean_and_share(r.phases.get(p)) for r in reports)) for p in phases]
    if any(has_memory(r.memory) for r in reports):  # a run without memory data: blank, not zero
        rows.append(("peak allocated", *(_mb(r.memory["peak_allocated_mb"]) if has_memory(r.memory) else ""
                                         for r in reports)))
    rows += rates.side_by_side_rows([r.throughput for r in reports], [r.flops for r in reports])
    align = ("left",) + ("right",) * len(reports)
    table = tabulate(rows, headers=("mean ms (share)", *labels), disable_numparse=True, colalign=align)
    return f"side by side ({len(reports)} runs)\n{table}"


def format_text(reports: Sequence[RunReport]) -> str:
    parts = [format_run(r) for r in reports]
    if len(reports) > 1:
        parts.append(format_comparison(reports))
    return "\n\n".join(parts)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def to_json(reports: Sequence[RunReport]) -> dict[str, Any]:
    """The ``--json`` document (schema in the module docstring)."""
    runs = []
    for r in reports:
        keys = _STAT_KEYS + (("p99_ms",) if r.source == "summary" else ())
        phases = {p: {**{k: _finite(getattr(s, k)) for k in keys}, "share": _finite(s.share)} for p, s in r.phases.items()}
        run = {
            "run": r.run,
            "source": r.source,
            "steps": r.steps,
            "windows": r.windows,
            "skipped_steps": r.skipped_steps,
            "phases": phases,
        }
        if r.summary is not None:
            run.update({k: r.summary.get(k) for k in _SUMMARY_KEYS})
            run["clock"] = r.clock
        run["memory"] = r.memory
        run["throughput"] = r.throughput
        run["flops"] = r.flops
        runs.append(run)
    return {"runs": runs}


# -- output: figure --------------------------------------------------------------------
#: One colour per built-in phase, the same in every panel and every figure (the TensorBoard
#: layout's order); custom phases take the colours after them.
_BUILTIN_COLORS = {
    "data_wait": "#8c564b", "sync_wait": "#e377c2", "h2d": "#9467bd", "forward": "#1f77b4", "backward": "#ff7f0e",
    "optimizer": "#2ca02c", "idle": "#7f7f7f", "between_steps": "#bcbd22", "step": "black", "period": "grey",
}
_OTHER_COLORS = ("#17becf", "#d62728", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2")


def _phase_colors(phases: list[str]) -> dict[str, Any]:
    custom = [p for p in phases if p not in _BUILTIN_COLORS]
    return {**_BUILTIN_COLORS, **{p: _OTHER_COLORS[i % len(_OTHER_COLORS)] for i, p in enumerate(custom)}}


def _device_phases(reports: Sequence[RunReport]) -> list[str]:
    """The step's phases: what its bar is made of."""
    return [p for p in ordered({q for r in reports for q in r.phases}) if share_base(p) == "step"]


def share_bars(reports: Sequence[RunReport]) -> dict[str, list[float]]:
    """What the figure's bars are made of: per step phase (built-in and custom, in order), its share of
    ``step`` in % per run (0 where a run lacks it); a run's widths add up to 100."""
    return {phase: [100 * (r.phases[phase].share or 0.0) if phase in r.phases else 0.0 for r in reports]
            for phase in _device_phases(reports)}


def _draw_shares(ax: Any, reports: Sequence[RunReport], labels: list[str], colors: dict[str, Any]) -> None:
    """Stacked horizontal bars: each step phase's share of ``step``, one bar per run."""
    y = list(range(len(reports)))[::-1]  # the first run on top
    lefts = [0.0] * len(reports)
    for phase, widths in share_bars(reports).items():
        bars = ax.barh(y, widths, left=lefts, color=colors[phase], label=phase, height=0.6)
        ax.bar_label(bars, labels=[f"{w:.0f}%" if w >= 4 else "" for w in widths], label_type="center", fontsize=8, color="white")
        lefts = [a + w for a, w in zip(lefts, widths)]
    ticks = []
    for r, label in zip(reports, labels):
        dw = r.phases.get("data_wait")
        ticks.append(label + (f"\ndata_wait: {_pct(dw.share)} of period" if dw is not None and dw.share is not None else ""))
    ax.set_yticks(y, ticks, fontsize=8)
    ax.set_ylim(-1, len(reports))  # bars of a sensible thickness for one run or many
    ax.set_xlim(0, max(100.0, *lefts))
    ax.set_xlabel("share of step (%)")
    ax.set_title("where the step goes (mean)", fontsize=10)


def _draw_distribution(ax: Any, reports: Sequence[RunReport], labels: list[str], colors: dict[str, Any]) -> None:
    """Per phase and run: p50 to p90 (thick), on to p99 or max (thin), the mean (dot); log scale in ms."""
    phases = ordered({p for r in reports for p in r.phases})
    n = len(reports)
    markers = ("o", "s", "^", "D", "v", "P")
    ticks, where = [], []
    for i, phase in enumerate(phases):
        base = (len(phases) - 1 - i) * (n + 1)
        for j, r in enumerate(reports):
            st = r.phases.get(phase)
            if st is None or st.p50_ms is None:
                continue
            yv = base + (n - 1 - j)
            top = st.p99_ms if st.p99_ms is not None else st.max_ms
            lo = max(st.p50_ms, 1e-3)
            ax.plot([lo, max(st.p90_ms or lo, 1e-3)], [yv, yv], color=colors[phase], linewidth=5, solid_capstyle="butt")
            if top is not None:
                ax.plot([max(st.p90_ms or lo, 1e-3), max(top, 1e-3)], [yv, yv], color=colors[phase], linewidth=1.2)
            if st.mean_ms is not None:
                ax.plot([max(st.mean_ms, 1e-3)], [yv], marker=markers[j % len(markers)], color="black", markersize=4)
        ticks.append(phase)
        where.append(base + (n - 1) / 2)
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    ax.set_yticks(where, ticks, fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("ms per step (log scale)")
    exact = all(r.source in ("summary", "step") for r in reports)
    top = "p99" if all(r.source == "summary" for r in reports) else "max"
    how = "over every step" if exact else "(window summaries where no per-step values)"
    title = f"distribution {how}: p50 to p90 thick, on to {top} thin, mean marked"
    if n > 1:
        shapes = ("●", "■", "▲", "◆", "▼", "✚")
        title += "\nruns, top to bottom: " + ", ".join(f"{lab} {shapes[j % len(shapes)]}" for j, lab in enumerate(labels))
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", alpha=0.3, which="both")


def _aligned(points: Points, xs: list[int]) -> list[float]:
    at = dict(points)
    return [at.get(x, 0.0) for x in xs]


def _draw_timeline(ax: Any, report: RunReport, label: str, colors: dict[str, Any]) -> None:
    """The step's phases stacked over the run (window means), the host's waits stacked above them up to
    ``period``; ``step`` and ``period`` as lines; custom phases as thin lines."""
    tl = {p: pts for p, pts in report.timeline.items() if pts}
    xs = sorted({s for pts in tl.values() for s, _ in pts})
    if not xs:
        return
    inside = [p for p in tl if p in STEP_PHASES]
    waits = [p for p in ("data_wait", "sync_wait", "between_steps") if p in tl]
    if inside:
        ax.stackplot(xs, *(_aligned(tl[p], xs) for p in inside), colors=[colors[p] for p in inside], labels=inside,
                     alpha=0.9)
    base = _aligned(tl["step"], xs) if "step" in tl else [sum(v) for v in zip(*(_aligned(tl[p], xs) for p in inside))]
    for p in waits:
        top = [b + v for b, v in zip(base, _aligned(tl[p], xs))]
        ax.fill_between(xs, base, top, color=colors[p], alpha=0.45, label=p, linewidth=0)
        base = top
    for p in TOTALS:
        if p in tl:
            style = {"color": colors[p], "linewidth": 1.4, "linestyle": "-" if p == "step" else "--"}
            ax.plot(*zip(*tl[p]), label=p, **style)
    for p in tl:
        if p not in _BUILTIN_COLORS:
            ax.plot(*zip(*tl[p]), color=colors[p], linewidth=1.2, linestyle=":", label=p)
    what = "window mean" if report.source != "step" else "per step"
    ax.set_title(f"{label}: where the time goes over the run ({what}; the waits stacked above the step)", fontsize=10)
    ax.set_ylabel("ms per step")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(xs[0], xs[-1] if len(xs) > 1 else xs[0] + 1)


#: The memory panel: one line style per quantity, one colour per run.
_MEMORY_STYLES = {"step_begin": ("allocated at the step's begin", "-"), "activations": ("activations", "--"),
                  "peak_allocated": ("peak allocated", ":")}
_RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _draw_memory(ax: Any, reports: Sequence[RunReport], labels: list[str]) -> None:
    """Allocated at the step's begin, activations and the peak allocated over the steps, every run on one scale."""
    top = max(v for r in reports for pts in r.memory_timeline.values() for _, v in pts)
    scale, unit = (1024.0, "GiB") if top >= 1024 else (1.0, "MiB")  # GiB once a value reaches one
    for j, (r, label) in enumerate(zip(reports, labels)):
        for what, pts in r.memory_timeline.items():
            name, style = _MEMORY_STYLES[what]
            xs, ys = zip(*pts)
            ax.plot(xs, [y / scale for y in ys], color=_RUN_COLORS[j % len(_RUN_COLORS)], linestyle=style,
                    linewidth=1.4, marker="." if len(pts) < 40 else None,
                    label=name if len(reports) == 1 else f"{label}: {name}")
    ax.set_title(f"memory over the run ({_memory_sources(reports, labels)})", fontsize=10)
    ax.set_ylabel(unit)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best", ncol=min(3, len(reports)))


def _memory_sources(reports: Sequence[RunReport], labels: list[str]) -> str:
    """Where the memory panel's lines come from; the runs named only where the sources differ."""
    how = {"TensorBoard": f"TensorBoard's {MEMORY_PREFIX}/*, a point per memory step",
           FILE_NAME: "the summary file's samples, its peak and mean activations flat"}
    by = {src: [lab for r, lab in zip(reports, labels) if r.memory_from == src] for src in how}
    used = [src for src in how if by[src]]
    if len(used) == 1:
        return how[used[0]]
    return "; ".join(f"{', '.join(by[src])}: {how[src]}" for src in used)


def _draw_throughput(fig: Any, cell: Any, reports: Sequence[RunReport], labels: list[str]) -> None:
    """The headline rate over the run (left) and MFU beside it (right), where a run has MFU; one colour per run."""
    timelines = [r.rate_timeline for r in reports]
    with_mfu = any(any(k in t for k in ("step", "forward", "backward")) for t in timelines)
    cells = cell.subgridspec(1, 2, width_ratios=(1, 1.5)) if with_mfu else None
    rate_ax = fig.add_subplot(cells[0, 0] if cells is not None else cell)
    rates.draw_rates(rate_ax, timelines, labels, _RUN_COLORS, [r.rate_from for r in reports])
    if cells is not None:
        rates.draw_mfu(fig.add_subplot(cells[0, 1]), timelines, labels, _RUN_COLORS,
                       [rates.peak_label(r.flops) for r in reports])


def write_png(reports: Sequence[RunReport], path: str) -> None:
    """Shares and the distribution (left), the phases stacked over the run (right, one row per run), into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = run_labels(reports)
    colors = _phase_colors(ordered({p for r in reports for p in r.phases}))
    n = len(reports)
    rows = max(2, n)
    memory = any(r.memory_timeline for r in reports)  # no memory data: no panel, the figure as it was
    throughput = rates.has_panel([r.rate_timeline for r in reports])  # likewise without rates
    extra = int(memory) + int(throughput)
    fig = plt.figure(figsize=(15, 3.0 + 3.0 * n + 3.0 * extra), layout="constrained")
    grid = fig.add_gridspec(rows + extra, 2, width_ratios=(1, 1.5))
    half = max(1, rows // 2)
    _draw_shares(fig.add_subplot(grid[:half, 0]), reports, labels, colors)
    _draw_distribution(fig.add_subplot(grid[half:rows, 0]), reports, labels, colors)
    if n > 1:  # one y scale for every run: heights compare at a glance
        first = fig.add_subplot(grid[0, 1])
        axes = [first] + [fig.add_subplot(grid[i, 1], sharex=first, sharey=first) for i in range(1, n)]
    else:
        axes = [fig.add_subplot(grid[:rows, 1])]
    for ax, r, label in zip(axes, reports, labels):
        _draw_timeline(ax, r, label, colors)
    top = max(ax.get_ylim()[1] for ax in axes)
    for ax in axes:
        ax.set_ylim(0, top)
    axes[-1].set_xlabel("step")
    phase_axes = list(fig.axes)  # the phase legend's: the memory and throughput panels keep their own
    if memory:
        _draw_memory(fig.add_subplot(grid[rows, :]), reports, labels)
    if throughput:
        _draw_throughput(fig, grid[rows + int(memory), :], reports, labels)
    handles = {h.get_label(): h for ax in phase_axes for h in ax.get_legend_handles_labels()[0]}
    names = ordered(list(handles))
    fig.legend([handles[p] for p in names], names, loc="outside lower center", ncol=min(len(names), 10), frameon=False)
    fig.suptitle("phase-timer")
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise ReportError(f"{path}: cannot write the figure ({err.strerror or err})") from err
    finally:
        plt.close(fig)


# -- command line ----------------------------------------------------------------------
def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="a run directory, or a directory above runs")
    parser.add_argument(
        "--json",
        action="store_true",
        help='print JSON instead of tables: {"runs": [{"run", "source", "steps", "windows", "skipped_steps", '
        '"phases": {PHASE: {"mean_ms", "p50_ms", "p90_ms", "max_ms", "share"}}, "memory": {...} or null, '
        '"throughput": {...} or null, "flops": {...} or null}]}',
    )
    parser.add_argument("--png", metavar="FILE", help="also write a figure: phase shares and phase times over steps "
                        "(and memory over steps, when a run has memory data; throughput and MFU over steps, when a "
                        "run has them)")
    parser.add_argument(
        "--source",
        choices=("auto", "summary", "step", "window"),
        default="auto",
        help=f"statistics from the run's {FILE_NAME} (its own totals over every step, with its verdict), from "
        "per-step values (exact; needs per_step=True), from the window summaries, or auto: the first of these "
        "the run has (default)",
    )


REPORT_HELP = (
    "Tables of where each step's time went, per phase: mean, p50, p90, max (ms) and share of the step. "
    "From per-step values (runs logged with per_step=True) the statistics are exact; from the window summaries "
    "alone the columns are: mean = mean of window means (every window weighs the same), p50 = median of window p50, "
    "p90 = max of window p90, max = max of window max.  Share: the step's phases (h2d, forward, backward, "
    "optimizer, idle, custom phases inside the step) of `step`, the rest (data_wait, sync_wait, between_steps, "
    "custom phases after the step's end: between_steps.<name>) of `period`.  Below each table: the run's "
    "throughput (tokens/s, samples/s, steps/s) and MFU with its denominator, where the run has them."
)


def run_report(args: argparse.Namespace) -> int:
    require("tensorboard", *([] if args.json else ["tabulate"]), *(["matplotlib"] if args.png else []))
    reports = load_runs(args.logdirs, args.source)
    if args.png:
        write_png(reports, args.png)
    if args.json:
        print(json.dumps(to_json(reports), indent=2))
    else:
        print(format_text(reports))
    if args.png:
        print(f"{PROG} report: wrote {args.png}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m phase_timer.report LOGDIR ...``: the report alone (``phase-timer report`` is :mod:`phase_timer.cli`)."""
    parser = argparse.ArgumentParser(prog="python -m phase_timer.report", description=REPORT_HELP)
    add_report_args(parser)
    return run_command(PROG, "report", run_report, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
