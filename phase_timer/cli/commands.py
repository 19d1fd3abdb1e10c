"""The ``phase-timer`` command line: its parser, ``report`` and ``compare`` under it, and :func:`main`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from phase_timer.cli import compare, report
from phase_timer.cli.errors import PROG, run_command


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """``phase-timer report ...`` and ``phase-timer compare ...``."""
    parser = argparse.ArgumentParser(prog=prog, description="phase-timer tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report.add_report_args(sub.add_parser("report", help="summarize phase-timer runs", description=report.REPORT_HELP))
    compare.add_compare_args(
        sub.add_parser(
            "compare",
            help="is a candidate run slower than a baseline, where, and beyond noise (a CI gate)",
            description=(compare.__doc__ or "").split("\n\n", 2)[-1],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command.  Returns the exit status."""
    args = build_parser().parse_args(argv)
    run = compare.run_compare if args.command == "compare" else report.run_report
    return run_command(PROG, args.command, run, args)

