"""``phase-timer compare BASELINE CANDIDATE``: is the candidate slower, where, and beyond noise?

Usage::

    phase-timer compare BASELINE CANDIDATE [--metric mean|p50|p90] [--fail-above PCT]
                        [--fail-above-memory PCT] [--fail-below-throughput PCT]
                        [--phase NAME ...] [--json]

Each side is a run directory (its ``phase_timer_summary.json``, else its TensorBoard
files) or a summary file.  Where a side has no summary file (a run from before it
existed) its numbers come from the TensorBoard windows, and the output says so.

The noise band (batch means).  A run's logging windows are consecutive batches of
steps; the spread of a phase's window statistic from batch to batch says how much
that statistic moves by chance *within the run*.  For each side, the standard error
of the run's value is ``stdev(batch values) / sqrt(batches)``; the band of the
difference is ``Z * sqrt(se_baseline**2 + se_candidate**2)``, as a percentage of
the baseline (``Z`` = 3: about 99.7% for a normal spread).  Batches shorter
than half the median batch (a last, partial window) are left out; with fewer than
3 batches on a side the band is unknown.  Noise *between* runs (a
different machine, GPU clocks, a busier host) is not in it: that is what the
threshold is for.

The gate.  ``--fail-above PCT`` (off by default) checks ``step``, or each ``--phase``:
exit status 1 when the candidate's value is higher by more than ``PCT`` percent **and**
beyond the band (a phase whose band is unknown is gated on ``PCT`` alone, and the
output says so); 0 otherwise; 2 on bad input (a missing or corrupt run, no phase-timer
data, a gated phase missing on one side, runs on different clocks), with one line on
stderr.  Warnings (stderr) name what makes the runs hard to compare: a different
device, torch, world size, precision, batch size, door or set of phases.

Memory (CUDA runs).  When both sides have memory data, a memory table follows
(peak allocated, peak reserved, mean activations: baseline, candidate, change); from
a summary file its ``memory`` object, from TensorBoard alone the last
``phase_memory/*`` points and the mean of the activations'.  ``--fail-above-memory
PCT`` (off by default) gates the peak allocated: exit status 1 when the candidate's
is higher than the baseline's by more than ``PCT`` percent; 0 otherwise; 2 (one line
on stderr naming the path) when a side has no memory data (a CPU run, the host
clock, ``memory=False``).  It has no noise band: the allocator's counters are
deterministic in a steady loop (the same allocations in the same order give the same
bytes), so a difference is a change, not chance.

Throughput.  When both sides counted their batches, a throughput table follows: tokens/s,
samples/s, steps/s (this rank's; under torch.distributed the job's too), and from version-6
summary files TFLOP/s and MFU (step, forward, backward), each with its change.  A rate is a
ratio (counts over ``period``), so its band comes from the window batches' counts and periods
as a ratio estimator's: ``se(R) = sqrt(sum((count_i - R * period_i)**2) / (n * (n - 1))) /
mean(period_i)``, then ``Z`` of them for the difference, as for a phase.  A summary file keeps
each batch's steps and mean ``period``; where every step had the same count
(``throughput.per_step``) a batch's count is that count times its steps (the band is then, to
first order, the mean period's); TensorBoard keeps each window's rate.  A count that varied
from step to step, with no TensorBoard files beside the summary file, leaves the band unknown.
``--fail-below-throughput PCT`` (off by default) gates tokens/s (samples/s where a side counts
no tokens), this rank's: exit status 1 when the candidate's is lower by more than ``PCT``
percent **and** beyond the band (unknown: on ``PCT`` alone, and said); 2 when a side has no
throughput.  MFU is shown, not gated: for the same model on the same device it moves with
tokens/s, and a change of FLOP count or peak between the runs (warned) moves it with no change
in speed.  Any gate failing exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from phase_timer.cli.compare_json import to_json
from phase_timer.cli.compare_side import METRICS, load_side
from phase_timer.cli.compare_text import format_comparison
from phase_timer.cli.comparison import compare
from phase_timer.cli.errors import ReportError, require
from phase_timer.outputs.run_summary import FILE_NAME

#: The exit status when a gate fails.
EXIT_SLOWER = 1


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", metavar="BASELINE", help=f"a run directory or its {FILE_NAME}")
    parser.add_argument("candidate", metavar="CANDIDATE", help=f"a run directory or its {FILE_NAME}")
    parser.add_argument("--metric", choices=METRICS, default="mean", help="what is compared per phase (default mean)")
    parser.add_argument("--fail-above", type=float, metavar="PCT", default=None,
                        help="exit 1 when a gated phase is slower by more than PCT percent and beyond noise (default: off)")
    parser.add_argument("--fail-above-memory", type=float, metavar="PCT", default=None,
                        help="exit 1 when the candidate's peak allocated memory is higher than the baseline's by "
                        "more than PCT percent (no noise band: the allocator's counters are deterministic in a steady "
                        "loop); exit 2 when a side has no memory data (default: off)")
    parser.add_argument("--fail-below-throughput", type=float, metavar="PCT", default=None,
                        help="exit 1 when the candidate's tokens/s (samples/s where a side counts no tokens) is lower "
                        "than the baseline's by more than PCT percent and beyond noise; exit 2 when a side has no "
                        "throughput (default: off)")
    parser.add_argument("--phase", action="append", metavar="NAME",
                        help="a phase to gate and give a verdict on (repeatable; default step)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run_compare(args: argparse.Namespace) -> int:
    for flag, pct in (("--fail-above", args.fail_above), ("--fail-above-memory", args.fail_above_memory),
                      ("--fail-below-throughput", args.fail_below_throughput)):
        if pct is not None and not (math.isfinite(pct) and pct >= 0):
            raise ReportError(f"{flag} must be a percentage >= 0, got {pct}")
    if not args.json:
        require("tabulate")
    base, cand = load_side(args.baseline), load_side(args.candidate)
    result = compare(base, cand, metric=args.metric, gated=args.phase or ["step"], fail_above=args.fail_above,
                     fail_above_memory=args.fail_above_memory, fail_below_throughput=args.fail_below_throughput)
    for w in result.warnings:
        print(f"phase-timer compare: warning: {w}", file=sys.stderr)
    print(json.dumps(to_json(result), indent=2) if args.json else format_comparison(result))
    return EXIT_SLOWER if result.failed or result.memory_failed or result.throughput_failed else 0
