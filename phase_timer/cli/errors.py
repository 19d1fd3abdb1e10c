"""How a ``phase-timer`` command fails: bad input is one line on stderr naming the path, exit status 2.

Every problem with the input is a :class:`ReportError`; a missing optional package says which
extra to install.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

EXIT_ERROR = 2
PROG = "phase-timer"


class ReportError(Exception):
    """A problem with the input, reported as one line naming the path; exit status 2."""


def require(*names: str) -> None:
    """The optional packages an invocation needs, or one line saying how to get them."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ReportError(f"{name} is not installed ({err}): pip install 'phase-timer[report]'") from err


def run_command(prog: str, command: str, run: Any, args: Any) -> int:
    """Run one command: its exit status; a :class:`ReportError` is one line on stderr and status 2."""
    try:
        return run(args)
    except ReportError as err:
        print(f"{prog} {command}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `phase-timer report ... | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
