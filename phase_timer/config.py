"""Keyword-only configuration shared by both doors, checked when it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, NoReturn

from phase_timer import files
from phase_timer._env import env_flag
from phase_timer.trace import TraceWriter

#: Set to 1/true/yes/on to turn every phase-timer into a no-op without touching code.
DISABLE_ENV = "PHASE_TIMER_DISABLE"
#: Our own log directory's default name, in every door: not an identifier, so that no import
#: can take it for a package (a ``phase_timer/`` beside a script shadowed the real one).
DEFAULT_LOG_DIR = "phase-timer-logs"


def disabled_by_env() -> bool:
    return env_flag(DISABLE_ENV, default=False)


def _fail(owner: str, name: str, value: Any, expected: str, why: str = "") -> NoReturn:
    shown = _shown(value)
    got = f"got {shown}{'' if shown == f'<{type(value).__name__}>' else f' ({type(value).__name__})'}{why}"
    raise ValueError(f"{owner}({name}={shown}): `{name}` must be {expected}, {got}")


def _shown(value: Any, limit: int = 80) -> str:
    """The value as given, cut short: an error names what the user passed, not a transformation of it (an object
    whose repr spans lines, an optimizer's or a module's, by its type: the message says it once, on one line)."""
    text = repr(value)
    if "\n" in text:
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: A door's argument under another door's name: the name to use instead.
_OTHER_DOORS = {"window": "log_every_n_steps", "log_every_n_steps": "window"}


def reject_unknown(owner: str, fn: Any, unknown: Mapping[str, Any]) -> None:
    """A keyword ``fn`` (a door's constructor) does not take fails as Python would (TypeError), naming the one it
    does: another door's name for the same argument (``window=`` / ``log_every_n_steps=``), or the closest."""
    if not unknown:
        return
    import difflib
    import inspect

    known = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is not p.VAR_KEYWORD and n != "self"]
    name = next(iter(unknown))
    hint = _OTHER_DOORS.get(name) if _OTHER_DOORS.get(name) in known else None
    close = hint or next(iter(difflib.get_close_matches(name, known, n=1)), None)
    tip = (f": {owner}'s is `{hint}=` (another door calls it `{name}=`)" if hint else
           f": did you mean `{close}=`?" if close else f"; it takes {', '.join(known)}")
    raise TypeError(f"{owner}() got an unexpected keyword argument '{name}'{tip}")


def check_int(owner: str, name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(owner, name, value, f"an int >= {minimum}" + (" or None" if optional else ""))


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(owner, name, value, "True or False")


def check_count(owner: str, name: str, value: Any) -> None:
    """``None`` (read from the batch's shapes), an int >= 0, or a function of the batch."""
    if value is None or callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail(owner, name, value, "None (read from the batch's shapes), an int >= 0, or a function of the batch")


def check_seconds(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        _fail(owner, name, value, "a finite number of seconds > 0")


def check_path(owner: str, name: str, value: Any, *, kind: str = "file") -> None:
    """None, or a path that is not an existing thing of the other kind (``kind``: "file" or "directory")."""
    if value is None:
        return
    if not isinstance(value, (str, os.PathLike)):
        _fail(owner, name, value, "a path (str or os.PathLike) or None")
    if not os.fspath(value).strip():  # "" would mean the working directory, or a default, silently
        _fail(owner, name, value, "a path (str or os.PathLike) or None", ", which is empty (None for the default)")
    if kind == "directory" and os.path.exists(value) and not os.path.isdir(value):
        _fail(owner, name, value, "a directory (or a path to make one)", ", which is an existing file")
    if kind == "file" and os.path.isdir(value):
        _fail(owner, name, value, "a file path", ", which is an existing directory")


def _positive(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < float("inf"))


def check_flops(owner: str, name: str, value: Any) -> None:
    """``flops_per_step=``: None, FLOPs per step (an int or float > 0), or ``{"forward": f, "backward": b}``
    (each > 0; other phases may be named too)."""
    expected = 'FLOPs per step > 0, or {"forward": f, "backward": b} with f, b > 0'
    if value is None or _positive(value):
        return
    if isinstance(value, Mapping) and value:
        bad = [k for k, v in value.items() if not isinstance(k, str) or not _positive(v)]
        if not bad and "forward" in value and "backward" in value:
            return
        why = f", whose {_shown(bad[0])} is not a phase with FLOPs > 0" if bad else ", without forward and backward"
        _fail(owner, name, value, expected, why)
    _fail(owner, name, value, expected)


def check_peak(owner: str, name: str, value: Any) -> None:
    """``peak_tflops=``: None (the table's), or the device's dense peak in TFLOP/s, a finite number > 0."""
    if value is not None and not _positive(value):
        _fail(owner, name, value, "the device's dense peak in TFLOP/s (a finite number > 0), or None")


def check_snapshot(owner: str, value: Any) -> None:
    """``memory_snapshot``: None/False (off), True or ``"end"`` (the run's directory), or a file path."""
    if value is None or isinstance(value, bool) or value == "end":
        return
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        _fail(owner, "memory_snapshot", value, "None, True, 'end' or a file path for the snapshot")
    check_path(owner, "memory_snapshot", value, kind="file")


def check_nvtx(owner: str) -> None:
    """``nvtx=True`` needs torch's NVTX functions (a CUDA build); a CPU build lacks them."""
    try:
        import torch.cuda.nvtx as nvtx

        nvtx.range_push("phase-timer")
        nvtx.range_pop()
    except Exception as err:  # noqa: BLE001 - any failure means the ranges would fail mid-run
        _fail(owner, "nvtx", True, "False on this torch build", f": its NVTX ranges fail here ({err})")


@dataclass(frozen=True)
class TimerConfig:
    """What both doors accept.  ``window=None`` means: the framework's logging interval."""

    window: int | None = None
    warmup_steps: int = 5
    max_pending: int = 64
    per_step: bool = False
    summary: bool = True
    log_dir: str | os.PathLike[str] | None = None
    nvtx: bool = False
    trace_steps: tuple[int, int] | None = None
    trace_path: str | os.PathLike[str] | None = None
    rank_timeout_s: float = 30.0
    memory: bool = True
    #: A step's samples and tokens for its throughput: None reads them from each batch's shapes (tokens: the
    #: input ids' numel, padding included); or a count a batch, or a function of the batch (``throughput.py``).
    samples_per_batch: Any = None
    tokens_per_batch: Any = None
    #: FLOPs and MFU (``step_flops.py``): the step's FLOPs if given (else counted once per batch shape on an
    #: untimed step), the device's dense peak in TFLOP/s if given (else the table's), and whether to do it at all.
    flops_per_step: Any = None
    peak_tflops: Any = None
    mfu: bool = True
    #: Record the CUDA allocator's history and dump a snapshot on an out-of-memory error (``phase_timer/oom.py``):
    #: None (off), True (``memory_snapshot.pickle`` in the run's directory), ``"end"`` (also at the run's end), a path.
    memory_snapshot: Any = None
    owner: str = "PhaseTimer"
    #: What the door calls ``window`` (the Lightning callback: ``log_every_n_steps``).
    window_arg: str = "window"

    def __post_init__(self) -> None:
        o = self.owner
        check_int(o, self.window_arg, self.window, 1, optional=True)
        check_int(o, "warmup_steps", self.warmup_steps, 0)
        check_int(o, "max_pending", self.max_pending, 1)
        check_bool(o, "per_step", self.per_step)
        check_bool(o, "summary", self.summary)
        check_bool(o, "nvtx", self.nvtx)
        if self.nvtx:
            check_nvtx(o)
        check_path(o, "log_dir", self.log_dir, kind="directory")
        check_path(o, "trace_path", self.trace_path, kind="file")
        check_seconds(o, "rank_timeout_s", self.rank_timeout_s)
        check_bool(o, "memory", self.memory)
        check_count(o, "samples_per_batch", self.samples_per_batch)
        check_count(o, "tokens_per_batch", self.tokens_per_batch)
        check_bool(o, "mfu", self.mfu)
        check_flops(o, "flops_per_step", self.flops_per_step)
        check_peak(o, "peak_tflops", self.peak_tflops)
        check_snapshot(o, self.memory_snapshot)
        ts = self.trace_steps
        if ts is not None and not (
            isinstance(ts, tuple) and len(ts) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in ts)
            and 0 <= ts[0] < ts[1]
        ):
            _fail(o, "trace_steps", ts, "a tuple (first, stop) of ints with 0 <= first < stop, or None")

    def make_trace(self, log_dir: str | None, clock: str) -> TraceWriter | None:
        """The trace writer for ``trace_steps`` (default file: ``<log_dir>/phase_trace.json``)."""
        if self.trace_steps is None:
            return None
        path = self.trace_path or files.join(log_dir or ".", "phase_trace.json")
        return TraceWriter(path, *self.trace_steps, clock=clock)
