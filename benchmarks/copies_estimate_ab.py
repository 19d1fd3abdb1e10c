"""DDP's copies' estimate under other statistics, on the same steps: from ``comm_nccl.py --launches`` output files.

    python benchmarks/copies_estimate_ab.py FILE [...] [--out FILE]

phase-timer takes each bucket's median of its last queued samples off a synced backward's span, and each bucket's
quickest sample off a span that exceeds the median's sum by more than ``run.WAITED_MS`` (``run.less_copies``);
``comm_nccl.py`` prints every bucket's queued samples and, per step, the span before the copies came off (``before
cp``) and the blocked rule.  For each case and rank this recomputes each step's wait (never below zero) with each
statistic of the samples (the median, the lowest, the mean, and ``waited``: the median, the lowest on a step that
waited, as ``run.less_copies``) and counts the steps within 0.1 ms or 2% of the rule.  A step the paced path
corrected (``paced.PacedSpans``: the rows' ``paced`` column) is left out: its record already holds the host's time
less the run's estimate, which another estimate would not move; a table without that column leaves out every case
and rank whose summary counts a correction.  So is a step whose printed wait is not ``before cp`` less the run's own estimate (within 5 µs; where the table prints the run's
estimate for a step that waited, ``run.less_copies`` of the two).
"""

from __future__ import annotations

import os
import pathlib
import re
import statistics
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import nccl_latency  # noqa: E402
from benchmarks.nccl_truth import within  # noqa: E402
from phase_timer.measures.comm.run import less_copies  # noqa: E402


def _each(stat: Callable[[list[float]], float]) -> Callable[[float, list[list[float]]], float]:
    return lambda before, vals: max(0.0, before - sum(stat(v) for v in vals))


#: A step's wait from its span before the copies came off and its buckets' samples.
STATISTICS: dict[str, Callable[[float, list[list[float]]], float]] = {
    "median": _each(statistics.median), "lowest": _each(min), "mean": _each(statistics.fmean),
    "waited": lambda before, vals: less_copies(before, sum(statistics.median(v) for v in vals),
                                               sum(min(v) for v in vals))}
SAMPLES = re.compile(r"bucket (\d+): queued samples (\[[^\]]*\]|-)")


def samples(text: str, per_step: bool = False) -> dict[tuple[str, int], tuple[float, float | None, list[list[float]]]]:
    """Each case's and rank's copies' estimate as the run took it (and where a step waited: None where the table
    does not print one) and its buckets' queued samples (ms), from its queued-rule summary line; without
    ``per_step`` (the rows' own ``paced`` column), none for a case and rank whose paced path corrected a backward
    (its span's record holds that correction, itself the host's time less the estimate: another estimate would not
    move it)."""
    out = {}
    for line in text.splitlines():
        head = re.match(r"(\S+)\s+rank (\d+): .*queued rule.*copies estimate\s+([\d.]+)"
                        r"(?: \(([\d.]+) where a step waited\))?", line)
        paced = re.search(r"host-paced correction on (\d+) backwards", line)
        if head and "bucket 0:" in line and (per_step or not (paced and int(paced.group(1)))):
            low = float(head.group(4)) if head.group(4) else None
            out[(head.group(1), int(head.group(2)))] = (float(head.group(3)), low, [
                [float(v) for v in s.strip("[]").split(",")] for _, s in SAMPLES.findall(line) if s != "-"])
    return out


def rows(text: str) -> list[tuple[str, int, int, float, float, float, int | None]]:
    """Each step's (case, rank, step, wait, wait before the copies came off, blocked rule, the backwards the paced
    path corrected in it: None where the table has no such column) from the table."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 18 and f[1] in ("0", "1", "2", "3") and f[2].isdigit():
            try:
                paced = int(f[18]) if len(f) > 18 and f[18].isdigit() else None
                out.append((f[0], int(f[1]), int(f[2]), float(f[3]), float(f[4]), float(f[16]), paced))
            except ValueError:
                continue
    return out


def compare(text: str) -> dict[tuple[str, int], dict[str, int]]:
    """Per case and rank: the steps compared (``n``) and, per statistic, those within 0.1 ms or 2% of the rule."""
    steps = rows(text)
    per_step = bool(steps) and all(row[6] is not None for row in steps)
    buckets = samples(text, per_step)
    out: dict[tuple[str, int], dict[str, int]] = {}
    for case, rank, _, wait, before, rule, paced in steps:
        taken, low, vals = buckets.get((case, rank), (0.0, None, []))
        if not vals or paced:  # a step the paced path corrected: its record holds that correction
            continue
        as_run = max(0.0, before - taken) if low is None else less_copies(before, taken, low)
        if abs(as_run - wait) > 0.005:
            continue  # not the span less the run's estimate: a host-paced step's own correction
        counts = out.setdefault((case, rank), {"n": 0, **{name: 0 for name in STATISTICS}})
        counts["n"] += 1
        for name, stat in STATISTICS.items():
            counts[name] += within(stat(before, vals), rule)
    return out


def report(path: str) -> list[str]:
    text = pathlib.Path(path).read_text()
    first = text.splitlines()[0] if text else ""
    lines = [f"{path}: {first}"]
    totals = {"n": 0, **{name: 0 for name in STATISTICS}}
    for (case, rank), counts in sorted(compare(text).items()):
        for k, v in counts.items():
            totals[k] += v
        lines.append(f"  {case:14} rank {rank}: {counts['n']:2d} steps; within 0.1 ms or 2% of the blocked rule: "
                     + ", ".join(f"{name} {counts[name]}" for name in STATISTICS))
    lines.append(f"  all: {totals['n']} steps; " + ", ".join(f"{name} {totals[name]}" for name in STATISTICS))
    return lines


def main() -> None:
    nccl_latency.main(report)


if __name__ == "__main__":
    main()
