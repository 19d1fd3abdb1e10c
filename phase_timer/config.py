"""The rules the doors' arguments are checked by, when a door is built.

Each rule is ``check(owner, name, value)`` and fails fast with a ``ValueError`` that repeats
the call (``attach(window=0)``), says what the argument must be and what it got.  Which
argument takes which rule: :class:`phase_timer.doors.options.Options`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NoReturn

from phase_timer._env import env_flag

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


def check_snapshot(owner: str, name: str, value: Any) -> None:
    """``memory_snapshot``: None/False (off), True or ``"end"`` (the run's directory), or a file path."""
    if value is None or isinstance(value, bool) or value == "end":
        return
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        _fail(owner, name, value, "None, True, 'end' or a file path for the snapshot")
    check_path(owner, name, value, kind="file")


def check_nvtx(owner: str, name: str, value: Any) -> None:
    """True or False; True needs torch's NVTX functions (a CUDA build), which a CPU build lacks."""
    check_bool(owner, name, value)
    if not value:
        return
    try:
        import torch.cuda.nvtx as nvtx

        nvtx.range_push("phase-timer")
        nvtx.range_pop()
    except Exception as err:  # noqa: BLE001 - any failure means the ranges would fail mid-run
        _fail(owner, name, True, "False on this torch build", f": its NVTX ranges fail here ({err})")


def check_span(owner: str, name: str, value: Any) -> None:
    """None, or ``(first, stop)``: ints with ``0 <= first < stop``."""
    if value is not None and not (
        isinstance(value, tuple) and len(value) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value) and 0 <= value[0] < value[1]
    ):
        _fail(owner, name, value, "a tuple (first, stop) of ints with 0 <= first < stop, or None")
