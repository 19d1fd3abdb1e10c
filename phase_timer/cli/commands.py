"""The ``phase-timer`` command line: its parser, ``report``, ``compare``, ``watch`` and ``run`` under it, and :func:`main`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from phase_timer.cli import compare, launch, report, watch
from phase_timer.cli.errors import PROG, run_command


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """``phase-timer report|compare|watch|run ...``."""
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
    watch.add_watch_args(sub.add_parser("watch", help="a run as it trains, in the terminal", description=watch.WATCH_HELP))
    launch.add_run_args(sub.add_parser("run", help="time an unmodified training script: phase-timer run [OPTIONS] -- "
                                       "python train.py ARGS", description=launch.RUN_HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command.  Returns the exit status."""
    args = build_parser().parse_args(argv)
    run = {"compare": compare.run_compare, "report": report.run_report, "watch": watch.run_watch,
           "run": launch.run_script}[args.command]
    return run_command(PROG, args.command, run, args)

