"""``phase-timer watch``: a run as it trains, in the terminal, from the files it writes.

Usage::

    phase-timer watch [LOG_DIR] [--once] [--interval S] [--svg FILE]

``LOG_DIR`` is a run's directory (where its ``phase_timer_live.json``, summary file or event files are);
without it, the run whose files changed last under ``lightning_logs/``, ``phase-timer-logs/`` or a 🤗
``output_dir``'s ``runs/`` (and one level down), from the current directory.  The view redraws each
``--interval`` seconds (default 1) until the run ends or Ctrl-C; ``--once`` prints one frame and exits (a
finished run, a CI log); ``--svg FILE`` prints one frame and also writes it as an SVG image (rich's export: a
README's picture of a run).  It reads only files (:mod:`phase_timer.cli.watch_state`): it works from another
process, another machine on a shared file system, or after the run, and never touches the training
process.  A run with no window yet says so and waits; a directory deleted under the view keeps the last
frame and says so.  Needs ``rich``: ``pip install 'phase-timer[watch]'``.

Exit status: 0; 2 for a LOG_DIR that does not exist or is no directory, no run found, or ``rich`` missing.
"""

from __future__ import annotations

import argparse
import time

from phase_timer.cli.errors import ReportError
from phase_timer.cli.watch_state import RunState, check_log_dir, newest_run, read_state

WATCH_HELP = ("A live terminal view of a run from the files it writes: phase bars, period, throughput and MFU with "
              "their trend, exposed communication, memory, the ranks, the verdict so far and its first advice, "
              "phase-timer's own cost.")


def add_watch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", nargs="?", metavar="LOG_DIR",
                        help="a run's directory (default: the newest run under lightning_logs/, phase-timer-logs/, "
                             "a 🤗 output_dir's runs/)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between frames (default 1)")
    parser.add_argument("--svg", metavar="FILE", help="print one frame (as --once) and write it to FILE as an SVG image")


def _require_rich() -> None:
    try:
        import rich  # noqa: F401
    except ImportError as err:
        raise ReportError(f"rich is not installed ({err}): pip install 'phase-timer[watch]'") from err


def run_watch(args: argparse.Namespace) -> int:
    _require_rich()
    from rich.console import Console

    from phase_timer.cli.watch_view import frame

    run_dir = check_log_dir(args.log_dir) if args.log_dir else newest_run()
    console = Console(width=None if Console().is_terminal else 110, record=bool(args.svg))
    if args.once or args.svg:
        console.print(frame(read_state(run_dir)))
        if args.svg:
            try:
                console.save_svg(args.svg, title=f"phase-timer watch {run_dir}")
            except OSError as err:
                raise ReportError(f"--svg: cannot write {args.svg} ({err.strerror or err})") from err
        return 0
    return _live(console, run_dir, args.interval)


def _live(console: object, run_dir: str, interval: float) -> int:
    """Redraw until the run ends (one last frame) or Ctrl-C; a deleted directory keeps the last frame."""
    from rich.live import Live

    from phase_timer.cli.watch_view import frame

    last: RunState | None = None
    with Live(console=console, auto_refresh=False, transient=False) as live:  # type: ignore[arg-type]
        try:
            while True:
                state = read_state(run_dir)
                if state.status == "gone" and last is not None:
                    last.status, last.note = "gone", state.note
                    state = last
                live.update(frame(state), refresh=True)
                if state.status in ("ended", "gone"):
                    return 0
                last = state
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0
