"""One side of ``phase-timer compare``: a run's values and window batches, from its summary file or TensorBoard files.

A side is read from its summary file where it has one; the TensorBoard files beside it give only
what the file lacks (a version-1 file's windows, a rate whose count varied from step to step); a
run without a summary file is read from its TensorBoard windows, and the output says so.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from phase_timer.cli.errors import ReportError
from phase_timer.cli.rates import headline_rate
from phase_timer.cli.read import (
    CountBatch,
    check_event_file,
    read_phase_scalars,
    read_summary,
    run_dirs,
    summary_count_batches,
    tensorboard_count_batches,
    tensorboard_flops,
    tensorboard_memory,
    tensorboard_throughput,
)
from phase_timer.outputs.run_summary import FILE_NAME
from phase_timer.timing.stats import SERIES_STATS, percentile

METRICS = SERIES_STATS  # what each window batch keeps is what can be compared


@dataclass
class Side:
    """One run as ``compare`` reads it."""

    path: str
    #: "summary" (the run's own totals), "per-step" or "windows" (TensorBoard fallbacks).
    source: str
    steps: int | None
    clock: str | None
    #: phase -> metric -> the run's value (ms).
    values: dict[str, dict[str, float]]
    #: phase -> metric -> one value per batch of windows (ms), with each batch's steps.
    batches: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    #: Where the batches came from, when not from the summary file.
    batches_from: str | None = None
    environment: dict[str, Any] | None = None
    door: str | None = None
    interrupted: bool = False
    #: The summary file's ``memory`` object, or TensorBoard's (:func:`~phase_timer.cli.read.tensorboard_memory`); None:
    #: memory was not read.
    memory: dict[str, Any] | None = None
    #: The summary file's ``throughput`` object, or TensorBoard's; None: no batch was counted.
    throughput: dict[str, Any] | None = None
    #: rate name (``tokens_per_s`` ...) -> each batch of windows' steps, last step, count and period (ms).
    rate_batches: dict[str, list[CountBatch]] = field(default_factory=dict)
    #: The summary file's ``flops`` object (version 6), or what TensorBoard has of it; None: none.
    flops: dict[str, Any] | None = None
    #: The summary file's ``modules`` block (version 10); None: not measured, or read from TensorBoard.
    modules: dict[str, Any] | None = None
    #: What the run's own diagnosis says changed partway through it (RUN_CHANGED's ``why``): its means mix levels.
    changed: list[str] = field(default_factory=list)
    #: The summary file's ``ranks`` block (each rank's means; None: one process, or TensorBoard's).
    ranks: dict[str, Any] | None = None


def load_side(path: str) -> Side:
    """A run directory or a summary file; the TensorBoard windows where no summary file is.

    Bad input is a :class:`~phase_timer.cli.errors.ReportError`: one line on stderr, exit status 2.
    """
    if not os.path.exists(path):
        raise ReportError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        return _from_summary(path, read_summary(path))
    runs = run_dirs(path)
    direct = runs.get(os.path.normpath(path), ([], None))[1]  # the run's own summary, before any below it
    summaries = [direct] if direct else [s for _, s in runs.values() if s]
    if len(summaries) > 1:
        shown = ", ".join(summaries[:3]) + (", ..." if len(summaries) > 3 else "")
        raise ReportError(f"{path}: holds {len(summaries)} run summaries ({shown}); name one run")
    if summaries:
        return _from_summary(summaries[0], read_summary(summaries[0]))
    return _tensorboard_side(path, runs)


def _from_summary(path: str, data: dict[str, Any]) -> Side:
    phases = data.get("phases") or {}
    values = {
        p: {m: float(row[f"{m}_ms"]) for m in METRICS if isinstance(row.get(f"{m}_ms"), (int, float))}
        for p, row in phases.items()
    }
    steps = (data.get("steps") or {}).get("timed")
    if not steps or not values:
        raise ReportError(f"{path}: the run timed no steps ({(data.get('steps') or {}).get('untimed_reason') or 'none'})")
    env = data.get("environment") or {}
    side = Side(path=path, source="summary", steps=steps, clock=env.get("clock"), values=values,
                environment=env, door=data.get("door"), interrupted=bool(data.get("interrupted")),
                memory=data.get("memory"), throughput=data.get("throughput"), flops=data.get("flops"),
                changed=_changes(data.get("diagnosis")), ranks=data.get("ranks"), modules=data.get("modules"))
    windows = data.get("windows")
    if windows:
        side.batches = _summary_batches(windows)
        side.rate_batches = summary_count_batches(data)
        _rate_batches_beside(side)
        return side
    # A version-1 file: its windows are in the TensorBoard files beside it, if there are any.
    side.batches_from = "none (a version-1 summary file and no TensorBoard files beside it)"
    try:
        side.batches = _tensorboard_side(path, run_dirs(path)).batches
        side.batches_from = "TensorBoard windows beside the summary file"
    except ReportError:
        pass
    return side


def _changes(diagnosis: dict[str, Any] | None) -> list[str]:
    """RUN_CHANGED's words in a summary's diagnosis (the verdict or one of the findings beside it)."""
    if not diagnosis:
        return []
    found = [diagnosis, *(diagnosis.get("secondary") or ())]
    return [f["why"] for f in found if f.get("kind") == "RUN_CHANGED" and f.get("why")]


def _rate_batches_beside(side: Side) -> None:
    """A headline rate the summary file cannot give batches of (its count varied from step to step, or a file
    from before ``per_step``): each window's rate from the TensorBoard files beside it, where there are any."""
    name = headline_rate(side.throughput)
    if name is None or side.rate_batches.get(name):
        return
    try:
        side.rate_batches[name] = _tensorboard_side(side.path, run_dirs(side.path)).rate_batches.get(name, [])
    except ReportError:
        pass


def _summary_batches(windows: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    steps = windows.get("steps") or []
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for p, cols in (windows.get("phases") or {}).items():
        out[p] = {m: [(n, v) for n, v in zip(steps, cols.get(f"{m}_ms") or []) if v is not None] for m in METRICS}
    return out


def _tensorboard_side(path: str, runs: dict[str, tuple[list[str], str | None]]) -> Side:
    """A run's values and batches from its TensorBoard files (``runs``: :func:`run_dirs` of ``path``; one run only)."""
    found = []
    for run_dir, (files, _) in runs.items():
        for f in files:
            check_event_file(f)
        scalars = read_phase_scalars(run_dir) if files else None
        if scalars is not None and not scalars.empty:
            found.append((run_dir, scalars))
    if not found:
        raise ReportError(f"{path}: no {FILE_NAME} and no phase-timer scalars in its TensorBoard files")
    if len(found) > 1:
        raise ReportError(f"{path}: holds {len(found)} phase-timer runs ({', '.join(d for d, _ in found[:3])}); name one")
    run_dir, scalars = found[0]
    window_steps = dict(scalars.window_steps)
    batches: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for p, stats in scalars.window.items():
        batches[p] = {m: [(int(window_steps.get(s, 1)), v) for s, v in stats.get(m, [])] for m in METRICS}
    if scalars.step:  # per-step values: the run's exact statistics
        values = {}
        for p, pts in scalars.step.items():
            vs = sorted(v for _, v in pts)
            values[p] = {"mean": statistics.fmean(vs), "p50": percentile(vs, 50), "p90": percentile(vs, 90)}
        steps: int | None = len({s for pts in scalars.step.values() for s, _ in pts})
        source = "per-step"
    else:  # window statistics only: step-weighted means; p50 and p90 the windows' averaged
        values = {p: {m: _weighted(b[m]) for m in METRICS if b[m]} for p, b in batches.items()}
        steps = int(sum(window_steps.values())) or None
        source = "windows"
    return Side(path=run_dir, source=source, steps=steps, clock=None, values=values, batches=batches,
                memory=tensorboard_memory(scalars), throughput=tensorboard_throughput(scalars),
                rate_batches=tensorboard_count_batches(scalars), flops=tensorboard_flops(scalars))


def _weighted(batches: list[tuple[int, float]]) -> float:
    total = sum(n for n, _ in batches)
    return sum(n * v for n, v in batches) / total
