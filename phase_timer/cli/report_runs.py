"""What ``phase-timer report`` says of each run: its phase statistics and shares, and what the figure draws.

A run with a summary file is reported from it (the run's own statistics, memory, throughput and
verdict); a run without one from its TensorBoard scalars, per-step values where logged, else
the window summaries (the module docstring of :mod:`phase_timer.cli.report` says how).  The
figure's lines over the run come from the TensorBoard files where the run has them, a point per
window or memory step (the summary file keeps batches of windows, and no tokens/s a batch where
the count varied from step to step), else from the summary file.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phase_timer.cli.errors import ReportError
from phase_timer.cli.rates import RATES, headline_rate
from phase_timer.cli.read import (
    MFU_TAGS,
    PhaseScalars,
    Points,
    check_event_file,
    read_phase_scalars,
    read_summary,
    run_dirs,
    summary_count_batches,
    tensorboard_flops,
    tensorboard_memory,
    tensorboard_throughput,
)
from phase_timer.phases import ordered, share_base
from phase_timer.outputs.run_summary import FILE_NAME
from phase_timer.timing.stats import WINDOW_STATS, percentile
from phase_timer.outputs.tags import STEP_PREFIX, WINDOW_PREFIX


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
    #: The summary file's ``memory`` object, or :func:`~phase_timer.cli.read.tensorboard_memory`'s; None: not read.
    memory: dict[str, Any] | None = None
    #: What the figure's memory panel draws (MB): ``step_begin``, ``activations``, ``peak_allocated`` points.
    memory_timeline: dict[str, Points] = field(default_factory=dict)
    #: Where ``memory_timeline`` came from: "TensorBoard" or the summary file's name (None: no memory data).
    memory_from: str | None = None
    #: The summary file's ``throughput`` object, or TensorBoard's
    #: (:func:`~phase_timer.cli.read.tensorboard_throughput`); None: no batch was counted.
    throughput: dict[str, Any] | None = None
    #: The summary file's ``flops`` object (version 6), or what TensorBoard has of it; None: none.
    flops: dict[str, Any] | None = None
    #: What the figure's throughput panel draws (:func:`_rate_points`) and its source.
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
    points, source = _rate_points(scalars, data)
    return {"rate_timeline": points, "rate_from": source}

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


def _rate_points(scalars: PhaseScalars, data: dict[str, Any] | None) -> tuple[dict[str, Points], str | None]:
    """What the throughput panel draws: the headline rate and the MFUs over the run, by the summary's names
    (``tokens_per_s`` or ``samples_per_s``; ``step``, ``forward``, ``backward`` for MFU), and where they came from.

    TensorBoard's ``throughput/*`` windows where the run has them (a value per window, exact).  Else the summary
    file's window batches: a rate where every step had the same count
    (:func:`~phase_timer.cli.read.summary_count_batches`), an MFU as the run's scaled by the run's mean time over the
    batch's (exact where every step had the same FLOPs: one batch shape)."""
    tp = scalars.throughput
    name = headline_rate({k: 1.0 for k in RATES if tp.get(k)})
    if name is not None:
        out = {name: tp[name], **{k: tp[tag] for k, tag in MFU_TAGS.items() if tp.get(tag)}}
        return out, "TensorBoard"
    if not data:
        return {}, None
    out: dict[str, Points] = {}
    batches = summary_count_batches(data)
    name = headline_rate({k: 1.0 for k in RATES if k != "steps_per_s" and batches.get(k)})
    if name is not None:
        out[name] = [(last, count * 1e3 / ms) for _, last, count, ms in batches[name]]
    out.update(_summary_mfu(data))
    return out, (FILE_NAME if out else None)


def _summary_mfu(data: dict[str, Any]) -> dict[str, Points]:
    mfu = ((data.get("flops") or {}).get("mfu")) or {}
    windows, phases = data.get("windows") or {}, data.get("phases") or {}
    columns = windows.get("phases") or {}
    out = {}
    for key, phase in (("step", "period"), ("forward", "forward"), ("backward", "backward")):
        run_ms = (phases.get(phase) or {}).get("mean_ms")
        means = (columns.get(phase) or {}).get("mean_ms") or []
        if mfu.get(key) is not None and run_ms:
            out[key] = [(s, mfu[key] * run_ms / ms) for s, ms in zip(windows.get("last_step") or [], means) if ms]
    return {k: v for k, v in out.items() if v}
