"""Runs nobody closed: written at interpreter exit, and on SIGTERM before the signal goes on.

Every door registers its open run here (a weak reference to its close; closing
unregisters it).  What was measured is never lost for want of a ``close()``:

* **At interpreter exit** (``atexit``), each run still open is closed, once, with a warning
  that it was not closed.  An uncaught exception that ends the program marks it interrupted
  (Python sets ``sys.last_value`` before the exit handlers run).
* **On SIGTERM** (a cluster's preemption notice, ``kill``, torchrun stopping its workers) the
  signal goes on to what was there before.  Where the program had a handler of its own
  (Lightning's, a requeue handler), it is called and nothing else happens: the process goes
  on, or ends, through that handler, and the doors' own ends (an exception leaving the loop,
  ``teardown``, the exit handler above) write the run, marked interrupted.  Where there was
  none (the default, which ends the process at once) every open run is written first, marked
  interrupted, *without waiting for the device* (it may be stuck in a collective: the steps it
  finished are kept), then the default is put back and the signal raised again, so the process
  ends exactly as it would have, with the same status.  Never installed when SIGTERM was
  ignored (the process lives on) or its handler is not Python's (it could not be chained), nor
  off the main thread (Python allows handlers only there).  Put back when the last open run
  closes, unless the program replaced it since.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from phase_timer._env import warn

log = logging.getLogger(__name__)

#: Open runs: id -> a weak reference to the method that closes one (``close(interrupted: bool, why: str)``).
_open: dict[int, weakref.WeakMethod] = {}
_ids = itertools.count()
#: Reentrant: a SIGTERM handled while this thread holds it (a run registering) takes it again in ``_close_all``.
_lock = threading.RLock()
_atexit_registered = False
#: The SIGTERM handler that was there when ours went in (ours: installed while ``_ours`` is set).
_previous: Any = None
_ours: Any = None
#: A SIGTERM came (a handler of the program's took it on): a run written at exit after it was interrupted.
_sigterm_seen = False
#: The process that installed the handler: a forked child (a DataLoader worker) inherits it, and its copies
#: of the open runs are not its own to write.
_pid = -1


def register(close: Callable[[bool, str], Any], *, sigterm: bool = True) -> int:
    """Track an open run until :func:`unregister`; ``close`` is a bound method (held weakly).

    ``sigterm=False`` (torch.distributed): no SIGTERM handler for this run.  A Python handler runs only when
    the main thread next runs Python, so a rank stuck in a collective (in C) would no longer end at once on
    SIGTERM, as it does by default; such a run is still written at exit and by the doors' own ends.
    """
    global _atexit_registered
    with _lock:
        for dead in [k for k, ref in _open.items() if ref() is None]:  # collected without their close
            del _open[dead]
        key = next(_ids)
        _open[key] = weakref.WeakMethod(close)  # type: ignore[arg-type]
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
    if sigterm:
        _install_sigterm()
    return key


def unregister(key: int | None) -> None:
    if key is None:
        return
    with _lock:
        _open.pop(key, None)
        empty = not _open
    if empty:
        _uninstall_sigterm()


def _close_all(interrupted: bool, why: str) -> None:
    with _lock:
        closes = [ref() for ref in reversed(list(_open.values()))]  # the newest run first
        _open.clear()
    for close in closes:
        if close is None:
            continue
        try:
            close(interrupted, why)
        except Exception as err:  # noqa: BLE001 - never in the way of the exit or the signal
            warn(log, f"phase-timer: could not write an unclosed run ({type(err).__name__}: {err})")


def _at_exit() -> None:
    _close_all(getattr(sys, "last_value", None) is not None or _sigterm_seen, "at interpreter exit")


def _install_sigterm() -> None:
    global _previous, _ours
    if _ours is not None or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, AttributeError):  # pragma: no cover - a platform without SIGTERM
        return
    if previous is signal.SIG_IGN or previous is None:  # ignored (lives on), or set outside Python (no chain)
        return
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # pragma: no cover - not allowed here
        return
    global _pid
    _previous, _ours, _pid = previous, _on_sigterm, os.getpid()


def _uninstall_sigterm() -> None:
    global _previous, _ours
    if _ours is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _ours:  # replaced since: the program's handler stays
            signal.signal(signal.SIGTERM, _previous)
    except (ValueError, OSError):  # pragma: no cover
        pass
    _previous = _ours = None


def _on_sigterm(signum: int, frame: Any) -> None:
    """Let the signal do what it would have done without us; where that ends the process at once, write first."""
    global _sigterm_seen
    _sigterm_seen = True
    previous = _previous
    if callable(previous) and previous is not _on_sigterm:
        previous(signum, frame)  # the program's own: it decides (the doors' ends write the run)
        return
    if os.getpid() == _pid:  # not in a forked worker: its copies of the runs are the parent's
        _close_all(True, "on SIGTERM")
        _uninstall_sigterm()  # (if the last run's close did not already)
    # The default: end the process by this very signal, as it would have ended.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
