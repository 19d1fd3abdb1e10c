"""The ``phase-timer`` command line, ``phase-timer report|compare ...``: :func:`main` is the console script.

Its modules, one job each:

- ``commands``: the parser and :func:`main`; ``report`` and ``compare``: each command's arguments and run
  (their docstrings are the commands' reference); ``errors``: how a command fails
- ``read``: the one reader of a run, its summary file and its TensorBoard event files
- ``rates``: throughput and MFU as both commands print them
- ``report_runs``: what a report says of each run; ``report_text``, ``report_json``, ``report_plot``: its outputs
- ``compare_side``: one side of a comparison; ``compare_rows``: its rows and noise bands; ``comparison``: the
  gates, verdicts and warnings; ``compare_text``, ``compare_json``: its outputs

The two commands share ``read``, ``rates`` and ``errors``, and never import each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phase_timer.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]


def __getattr__(name: str) -> Any:
    # Imported at first use, not here, so that ``python -m phase_timer.cli.report`` runs a module the package has
    # not imported already (runpy warns of that), and reading one module loads no command.
    if name in __all__:
        from phase_timer.cli import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
