"""The one reader of a run: its summary file and its TensorBoard event files, for ``report`` and ``compare``.

A run is a directory with TensorBoard event files holding phase-timer's scalars, a run
summary file (``phase_timer_summary.json``), or both.  For a run without a summary file,
``tensorboard_*`` give what its scalars hold in the summary file's names.  Every problem
with the input is a :class:`~phase_timer.cli.errors.ReportError`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from phase_timer.cli.errors import ReportError, require
from phase_timer.measures.memory import STEADY_FROM
from phase_timer.outputs.tags import (
    MEMORY_PREFIX,
    MEMORY_RANKS_PREFIX,
    SKIPPED_TAG,
    STEP_PREFIX,
    WINDOW_PREFIX,
    WINDOW_STEPS_TAG,
)
from phase_timer.outputs.run_summary import FILE_NAME, SCHEMA
from phase_timer.timing.stats import WINDOW_STATS
from phase_timer.measures.throughput import COUNTS
from phase_timer.measures.throughput import PREFIX as THROUGHPUT_PREFIX

_WINDOW_RE = re.compile(rf"^{WINDOW_PREFIX}/(.+)_ms/({'|'.join(WINDOW_STATS)})$")
_STEP_RE = re.compile(rf"^{STEP_PREFIX}/(.+)_ms$")
_MEMORY_RE = re.compile(rf"^{MEMORY_PREFIX}/(.+)_mb$")
_MEMORY_RANKS_RE = re.compile(rf"^{MEMORY_RANKS_PREFIX}/peak_allocated_mb/(.+)$")
_THROUGHPUT_RE = re.compile(rf"^{THROUGHPUT_PREFIX}/(.+)$")
#: Run summary file versions this phase-timer reads.
READS_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)

Points = list[tuple[int, float]]


@dataclass
class PhaseScalars:
    """A run's phase-timer scalars: ``window[phase][stat]`` and ``step[phase]`` points."""

    window: dict[str, dict[str, Points]] = field(default_factory=dict)
    step: dict[str, Points] = field(default_factory=dict)
    skipped: Points = field(default_factory=list)
    #: Each window's step count, at its last step.
    window_steps: Points = field(default_factory=list)
    #: Memory (CUDA runs): ``phase_memory/<what>_mb`` points (MB) by ``<what>``, one per memory step.
    memory: dict[str, Points] = field(default_factory=dict)
    #: Across ranks: ``phase_memory_ranks/peak_allocated_mb/<stat>`` points by ``<stat>``.
    memory_ranks: dict[str, Points] = field(default_factory=dict)
    #: ``throughput/<name>`` points by ``<name>`` (``samples_per_s``, ``tokens_per_s``, ``mfu``, ``job_...``),
    #: one per window.
    throughput: dict[str, Points] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        # Memory and throughput points come with a run's time points, never alone: they do not make a run.
        return not self.window and not self.step


# -- finding and reading runs ---------------------------------------------------------
def _is_event_file(name: str) -> bool:
    require("tensorboard")  # report and compare walk run directories through here
    from tensorboard.backend.event_processing.io_wrapper import IsSummaryEventsFile

    return IsSummaryEventsFile(name)


def _raise_walk_error(err: OSError) -> None:
    raise ReportError(f"{err.filename}: cannot list ({err.strerror or err})")


def check_event_file(path: str) -> None:
    """Walk the record framing (length, checksum); raise :class:`ReportError` where it breaks.

    Only the 12-byte headers are checked (payload checksums cost a pure-Python CRC
    over the whole file); a trailing partial record is what a live writer leaves.
    """
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            offset = 0
            while offset + 12 <= size:
                header = f.read(12)
                (length,), (crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
                if masked_crc32c(header[:8]) != crc:
                    raise ReportError(f"{path}: corrupt event file (bad record header at byte {offset})")
                offset += 12 + length + 4
                f.seek(offset)
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err.strerror or err})") from err


def read_phase_scalars(run_dir: str) -> PhaseScalars:
    """The phase-timer scalars of the event files directly in ``run_dir`` (all points kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    try:
        acc.Reload()
    except Exception as err:  # noqa: BLE001 - tensorboard's reader raises its own error types
        raise ReportError(f"{run_dir}: cannot read event files ({type(err).__name__}: {err})") from err
    out = PhaseScalars()
    for tag in acc.Tags().get("scalars", []):
        points = [(e.step, e.value) for e in acc.Scalars(tag)]
        if m := _WINDOW_RE.match(tag):
            out.window.setdefault(m.group(1), {})[m.group(2)] = points
        elif m := _STEP_RE.match(tag):
            out.step[m.group(1)] = points
        elif tag == SKIPPED_TAG:
            out.skipped = points
        elif tag == WINDOW_STEPS_TAG:
            out.window_steps = points
        elif m := _MEMORY_RE.match(tag):
            out.memory[m.group(1)] = points
        elif m := _MEMORY_RANKS_RE.match(tag):
            out.memory_ranks[m.group(1)] = points
        elif m := _THROUGHPUT_RE.match(tag):
            out.throughput[m.group(1)] = points
    return out


def _mean_max(points: Points) -> dict[str, float] | None:
    values = [v for _, v in points]
    return {"mean": sum(values) / len(values), "max": max(values)} if values else None


def tensorboard_memory(scalars: PhaseScalars) -> dict[str, Any] | None:
    """A run's memory from its ``phase_memory/*`` points, in the summary file's names; None without any.

    For runs without a summary file.  The peaks are the last points (the allocator's peak never
    falls); the means leave out the first ``STEADY_FROM - 1`` points as the summary file's steady
    statistics leave out the first steps (the optimizer makes its state at the first one) -- the
    first memory steps are the first steps begun, so this is the same cut but for dropped steps.
    """
    mem = scalars.memory
    begin = mem.get("step_begin") or []
    if not begin:
        return None
    steady = lambda pts: pts[STEADY_FROM - 1:] if len(pts) >= STEADY_FROM else pts  # noqa: E731
    last = lambda what: mem[what][-1][1] if mem.get(what) else None  # noqa: E731
    allocated = {k: _mean_max(steady(mem[k])) for k in ("step_begin", "activations") if mem.get(k)}
    return {
        "source": "tensorboard",
        "samples": len(begin),
        "steady_samples": len(steady(begin)),
        "allocated_mb": allocated,
        "peak_allocated_mb": last("peak_allocated"),
        "peak_reserved_mb": last("peak_reserved"),
    }


# -- throughput and MFU -------------------------------------------------------------------
#: TensorBoard's per-window MFU tags (fractions) by the summary file's ``mfu`` keys.
MFU_TAGS = {"step": "mfu", "forward": "mfu_forward", "backward": "mfu_backward"}
#: What a window's value is a ratio over: its rate or MFU weighs by that phase's time in the window.
_OVER_PHASE = {"mfu_forward": "forward", "mfu_backward": "backward"}


def _time_weighted(points: Points, scalars: PhaseScalars, phase: str) -> float:
    """The run's value of a per-window ratio (a count or FLOPs over a phase's time in the window).

    A window's ``C_w / T_w`` weighed by ``T_w`` (its mean of ``phase`` times its steps, both logged at the
    window's last step) gives ``sum(C) / sum(T)``: the run's, as the summary file computes it.  Without
    those, the windows' plain mean."""
    means = dict((scalars.window.get(phase) or {}).get("mean") or [])
    steps = dict(scalars.window_steps)
    weights = [means.get(s, 0.0) * steps.get(s, 0.0) for s, _ in points]
    if all(w > 0 for w in weights):
        return sum(w * v for w, (_, v) in zip(weights, points)) / sum(weights)
    return sum(v for _, v in points) / len(points)


def tensorboard_throughput(scalars: PhaseScalars) -> dict[str, Any] | None:
    """A run's rates from its ``throughput/*_per_s`` windows, in the summary file's names; None without any."""
    tp = scalars.throughput
    mine = {f"{n}_per_s": _time_weighted(tp[f"{n}_per_s"], scalars, "period")
            for n in (*COUNTS, "steps") if tp.get(f"{n}_per_s")}
    if "samples_per_s" not in mine:
        return None
    job = {f"{n}_per_s": _time_weighted(tp[f"job_{n}_per_s"], scalars, "period")
           for n in COUNTS if tp.get(f"job_{n}_per_s")}
    return {"source": "tensorboard", "windows": len(tp["samples_per_s"]), **mine, "job": job or None}


def tensorboard_flops(scalars: PhaseScalars) -> dict[str, Any] | None:
    """A run's TFLOP/s and MFU from its ``throughput/`` windows, in the summary file's names (what TensorBoard
    lacks, the FLOPs a step and the peak, is null); None without any."""
    tp = scalars.throughput
    mfu = {k: _time_weighted(tp[tag], scalars, _OVER_PHASE.get(tag, "period")) if tp.get(tag) else None
           for k, tag in MFU_TAGS.items()}
    tflops = _time_weighted(tp["tflops_per_s"], scalars, "period") if tp.get("tflops_per_s") else None
    if tflops is None and mfu["step"] is None:
        return None
    return {"source": "tensorboard", "per_step": None, "tflops_per_s": tflops, "peak": None,
            "mfu": mfu if mfu["step"] is not None else None, "note": None}


#: A window batch's counts: (steps, last step, count, summed period in ms); a rate is count over period.
CountBatch = tuple[int, int, float, float]


def summary_count_batches(data: dict[str, Any]) -> dict[str, list[CountBatch]]:
    """Each window batch's counts and period from a summary file, by rate name (``samples_per_s`` ...).

    The file keeps no count per window, but it keeps each batch's steps and mean ``period``: where every counted
    step had the same count ``k`` (``throughput.per_step``), a batch's count is ``k`` times its steps (steps/s:
    ``k`` = 1, always).  A count that varied gets no batches: its noise is unknown."""
    windows, thr = data.get("windows") or {}, data.get("throughput") or {}
    period = ((windows.get("phases") or {}).get("period") or {}).get("mean_ms") or []
    if not thr or not period:
        return {}
    per_step = {**(thr.get("per_step") or {}), "steps": 1.0}
    rows = [(n, last, p) for n, last, p in zip(windows.get("steps") or [], windows.get("last_step") or [], period)
            if n and p]
    return {f"{name}_per_s": [(n, last, k * n, n * p) for n, last, p in rows] for name, k in per_step.items() if k}


def tensorboard_count_batches(scalars: PhaseScalars) -> dict[str, list[CountBatch]]:
    """The same from TensorBoard: each window's rate times its period (its mean ``period`` times its steps)."""
    steps = dict(scalars.window_steps)
    period = dict((scalars.window.get("period") or {}).get("mean") or [])
    out: dict[str, list[CountBatch]] = {}
    for name in (*COUNTS, "steps"):
        rows = [(int(steps[s]), s, v * steps[s] * period[s] / 1e3, steps[s] * period[s])
                for s, v in scalars.throughput.get(f"{name}_per_s", []) if steps.get(s) and period.get(s)]
        if rows:
            out[f"{name}_per_s"] = rows
    return out


def run_dirs(logdir: str) -> dict[str, tuple[list[str], str | None]]:
    """Runs at or under ``logdir``: each directory with event files or a run summary file, with both.

    ``logdir`` may also be a run summary file (any ``.json`` name): that run, with the event files beside it.
    """
    if os.path.isfile(logdir) and logdir.endswith(".json"):
        run_dir = os.path.dirname(logdir) or "."
        return {run_dir: (sorted(os.path.join(run_dir, f) for f in os.listdir(run_dir) if _is_event_file(f)), logdir)}
    if not os.path.exists(logdir):
        raise ReportError(f"{logdir}: no such directory")
    if not os.path.isdir(logdir):
        raise ReportError(f"{logdir}: not a directory (nor a run summary .json file)")
    found: dict[str, tuple[list[str], str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(logdir, onerror=_raise_walk_error):
        dirnames.sort()
        files = sorted(os.path.join(dirpath, f) for f in filenames if _is_event_file(f))
        if files or FILE_NAME in filenames:
            found[os.path.normpath(dirpath)] = (files, os.path.join(dirpath, FILE_NAME) if FILE_NAME in filenames else None)
    if not found:
        raise ReportError(f"{logdir}: no {FILE_NAME} and no TensorBoard event files (events.out.tfevents.*) in it or below")
    return found


def read_summary(path: str) -> dict[str, Any]:
    """A run summary file's content, checked to be one (a version this reads)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err.strerror or err})") from err
    except ValueError as err:
        raise ReportError(f"{path}: not JSON ({err})") from err
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ReportError(f"{path}: not a phase-timer run summary (no \"schema\": \"{SCHEMA}\")")
    if data.get("schema_version") not in READS_VERSIONS:
        raise ReportError(f"{path}: run summary version {data.get('schema_version')!r}; this phase-timer reads "
                           f"{', '.join(map(str, READS_VERSIONS))}")
    return data
