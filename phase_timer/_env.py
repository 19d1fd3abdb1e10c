"""Switches read from the environment, so a run can be changed without touching code."""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(name: str, default: bool) -> bool:
    """``name`` as a boolean: 1/true/yes/on or 0/false/no/off (any case); otherwise ``default``."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in _TRUE else False if value in _FALSE else default
