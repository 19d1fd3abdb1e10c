"""``phase-timer report``: runs, from their summary files or TensorBoard scalars, as tables, JSON or a figure.

Usage::

    phase-timer report LOGDIR [LOGDIR ...] [--json] [--png FILE] [--source auto|window|step]
    python -m phase_timer.cli.report LOGDIR [LOGDIR ...] [...]     # the same, without the word `report`

A LOGDIR is a run directory (event files directly in it) or any directory above
runs: every directory under it whose event files hold ``phase_time/`` scalars is
one run.  Files are read with TensorBoard's own ``EventAccumulator``.

Where the numbers come from (``source``):

``step``
    The run was logged with ``per_step=True``: statistics are exact, over every
    timed step's ``phase_time_step/<phase>_ms`` value (``auto`` prefers this).
``window``
    Only the per-window summaries ``phase_time/<phase>_ms/<stat>`` exist, and a
    window's step count is not logged, so the columns are summaries of
    summaries: mean = mean of window means (every window weighs the same),
    p50 = median of window p50, p90 = max of window p90, max = max of window
    max.  ``steps`` is then unknown (``null``).

``share`` is a phase's part of the time per step: the step's phases, built-in and
custom (``timer.phase("clip")`` inside the step), of ``step`` (total phase time over
total step time for ``step``; mean of window means over the same for ``window``), so
that they sum to 1; ``data_wait``, ``sync_wait``, ``between_steps`` and custom phases
after the step's end (``between_steps.<name>``) of ``period``
(:func:`phase_timer.phases.share_base`); ``step`` 1.0 and ``period`` ``null``.

``--json`` prints, instead of the tables::

    {"runs": [{"run": "<run directory>",
               "source": "window" | "step",
               "steps": <timed steps (int) or null for "window">,
               "windows": <logging windows (int)>,
               "skipped_steps": <steps left untimed by max_pending (int)>,
               "phases": {"<phase>": {"mean_ms": float, "p50_ms": float, "p90_ms": float,
                                      "max_ms": float, "share": float | null}},
               "memory": {...} | null,
               "throughput": {...} | null,
               "flops": {...} | null}]}

Phases appear in :func:`phase_timer.phases.ordered` order.  ``--png FILE`` also
writes a figure: phase shares of the step per run (left) and each phase's window
mean over the steps (right, one row per run).

Memory (CUDA runs).  A run with memory data gets a memory block under its
table: from its summary file, the block the run printed
(:func:`phase_timer.outputs.table.format_memory`); from TensorBoard alone, a shorter one from
the ``phase_memory/*`` scalars (the last peaks, the mean allocated at the step's begin
and activations).  ``memory`` in ``--json`` is the summary file's ``memory`` object as
it is there, or for a TensorBoard-only run the same names that TensorBoard has
(``source``: ``"tensorboard"``, ``samples``, ``steady_samples``, ``allocated_mb``,
``peak_allocated_mb``, ``peak_reserved_mb``); ``null`` where memory was not read (a CPU,
the host clock, ``memory=False``): absent, not zero.  The figure gets a memory panel
(allocated at the step's begin, activations and the peak over the steps) when a run has
memory data; without any it is as it was.

Throughput and MFU.  A run whose batches were counted gets the line it printed,
``throughput: 36.9k tokens/s, 288.0 samples/s, 3.0 steps/s`` (and the job's, across ranks),
and from a version-6 summary file with FLOPs a ``FLOPs:`` line (a step's, forward and backward,
counted or given; TFLOP/s) and the MFU line with its denominator, ``MFU 41% of 989 TFLOP/s
(bf16 dense, H100 SXM): forward 52%, backward 47%`` (:func:`phase_timer.measures.mfu.format_mfu`), or
the file's note on why there is none.  ``throughput`` and ``flops`` in ``--json`` are the
summary file's objects as they are there; for a run without one, what its TensorBoard
``throughput/*`` windows give (``source``: ``"tensorboard"``; each rate the windows' weighted by
their period, i.e. the run's total count over its total period; ``flops`` then has
``tflops_per_s`` and ``mfu`` only).  The figure gets a throughput panel (tokens/s, else
samples/s, over the run; from TensorBoard's windows, else from the summary file's window batches
where every step had the same count) and, beside it, MFU over the run (step, forward,
backward) when a run has it.

Exit status: 0 on success; 2 on a usage error or a log directory that does not
exist, holds no event files, holds no phase-timer scalars or holds a corrupt
event file (one line on stderr names the path).  A corrupt file is one whose
record framing breaks (a record header failing its checksum); a last record cut
short, as a run still writing leaves it, is not an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from phase_timer.cli.errors import PROG, require, run_command
from phase_timer.cli.report_json import to_json
from phase_timer.cli.report_plot import write_png
from phase_timer.cli.report_runs import load_runs
from phase_timer.cli.report_text import format_text
from phase_timer.outputs.run_summary import FILE_NAME


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="a run directory, or a directory above runs")
    parser.add_argument(
        "--json",
        action="store_true",
        help='print JSON instead of tables: {"runs": [{"run", "source", "steps", "windows", "skipped_steps", '
        '"phases": {PHASE: {"mean_ms", "p50_ms", "p90_ms", "max_ms", "share"}}, "memory": {...} or null, '
        '"throughput": {...} or null, "flops": {...} or null}]}',
    )
    parser.add_argument("--png", metavar="FILE", help="also write a figure: phase shares and phase times over steps "
                        "(and memory over steps, when a run has memory data; throughput and MFU over steps, when a "
                        "run has them)")
    parser.add_argument(
        "--source",
        choices=("auto", "summary", "step", "window"),
        default="auto",
        help=f"statistics from the run's {FILE_NAME} (its own totals over every step, with its verdict), from "
        "per-step values (exact; needs per_step=True), from the window summaries, or auto: the first of these "
        "the run has (default)",
    )


REPORT_HELP = (
    "Tables of where each step's time went, per phase: mean, p50, p90, max (ms) and share of the step. "
    "From per-step values (runs logged with per_step=True) the statistics are exact; from the window summaries "
    "alone the columns are: mean = mean of window means (every window weighs the same), p50 = median of window p50, "
    "p90 = max of window p90, max = max of window max.  Share: the step's phases (h2d, forward, backward, "
    "optimizer, idle, custom phases inside the step) of `step`, the rest (data_wait, sync_wait, between_steps, "
    "custom phases after the step's end: between_steps.<name>) of `period`.  Below each table: the run's "
    "throughput (tokens/s, samples/s, steps/s) and MFU with its denominator, where the run has them."
)


def run_report(args: argparse.Namespace) -> int:
    require("tensorboard", *([] if args.json else ["tabulate"]), *(["matplotlib"] if args.png else []))
    reports = load_runs(args.logdirs, args.source)
    if args.png:
        write_png(reports, args.png)
    if args.json:
        print(json.dumps(to_json(reports), indent=2))
    else:
        print(format_text(reports))
    if args.png:
        print(f"{PROG} report: wrote {args.png}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python -m phase_timer.cli.report") -> int:
    """``python -m phase_timer.cli.report LOGDIR ...``: the report alone (``phase-timer report`` is
    :mod:`phase_timer.cli`); ``prog``: the command's name in its help and errors."""
    parser = argparse.ArgumentParser(prog=prog, description=REPORT_HELP)
    add_report_args(parser)
    return run_command(PROG, "report", run_report, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
