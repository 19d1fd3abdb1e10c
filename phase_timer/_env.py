"""Small shared pieces: switches read from the environment, and how the timer warns."""

from __future__ import annotations

import logging
import os
import warnings

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(name: str, default: bool) -> bool:
    """``name`` as a boolean: 1/true/yes/on or 0/false/no/off (any case); otherwise ``default``."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in _TRUE else False if value in _FALSE else default


#: ``PHASE_TIMER_NATIVE=0``: the Python engine, torch's events and Python statistics, even where C is built.
NATIVE_ENV = "PHASE_TIMER_NATIVE"


def native_wanted() -> bool:
    return env_flag(NATIVE_ENV, default=True)


def warn(log: logging.Logger, msg: str, stacklevel: int = 2) -> None:
    """Raise ``msg`` as a RuntimeWarning at ``stacklevel`` (as counted from the caller); log it too where the
    program has configured logging (else Python's last-resort handler would print it a second time)."""
    if log.hasHandlers():
        log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)


def warn_once(log: logging.Logger, warned: set[str], key: str, msg: str, stacklevel: int = 2) -> None:
    """:func:`warn`, the first time ``key`` is seen in ``warned``."""
    if key not in warned:
        warned.add(key)
        warn(log, msg, stacklevel + 1)
