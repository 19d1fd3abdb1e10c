"""The device's launch latency beside a collective, from ``comm_nccl.py --dump`` files: why the blocked rule opens a
launch's window ``nccl_truth.LAUNCH_LATENCY_US`` after the host's call.

    python benchmarks/nccl_latency.py DUMP.json.gz [...] [--out FILE]

For each dump (one case and rank, its profiled steps): every kernel, memcpy or memset the host launched onto an idle
compute stream (its launch call ended after the stream's last activity ended), the time from the call's end to its
start on the device, split by whether a collective ran meanwhile (p10, median, p90, µs); then per step the blocked
rule as ``comm_nccl.py`` reads it (``latency`` µs after each call) and with no latency, the part of the latter in
windows of at most LAUNCH_LATENCY_US, the rule less the compute stream's own gaps (``nccl_truth.own_gaps``), and
phase-timer's reading of that step (its row in the dump), with its steps within 0.1 ms or 2% of either.  A rank whose
collective spins through a host-paced stretch (a rank waiting for its peer) counts each launch's latency there as
blocked when the window opens at the call's end: ~300-1100 launches a step on 200 parameter tensors.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import statistics
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.nccl_truth import (  # noqa: E402
    LAUNCH_LATENCY_US, _clip, _overlap, _union, blocked_windows, compute_stream, own_gap_medians, per_step_blocked,
    queued_gaps, step_exposed, within)
from phase_timer.phases import COMM_PARTS  # noqa: E402


def load(path: str) -> dict[str, Any]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def latencies(acts: list[tuple], launches: dict[int, float], comm: str = "nccl") -> tuple[list[float], list[float]]:
    """µs from each idle-stream launch's call end to its start: (with a collective running meanwhile, without)."""
    stream = compute_stream(acts)
    collectives = _union([(a[0], a[1]) for a in acts if comm in a[2].lower()])
    own = sorted((a[0], a[1], a[5]) for a in acts if a[4] == stream and comm not in a[2].lower())
    beside, alone = [], []
    end = None
    for start, stop, corr in own:
        launch = launches.get(corr)
        if end is not None and launch is not None and end < launch < start:
            (beside if _overlap(launch, start, collectives) > 0 else alone).append(start - launch)
        end = stop if end is None else max(end, stop)
    return beside, alone


def per_step(acts: list[tuple], launches: dict[int, float], comm: str = "nccl") -> list[dict[str, float]]:
    """Each step's blocked rule at LAUNCH_LATENCY_US and at none, the no-latency rule's part in windows of at most
    LAUNCH_LATENCY_US, and the first less its part in the compute stream's own gaps (``nccl_truth.own_gaps``: each
    queued gap's last m µs where a collective runs beside it, m its transition's median with no collective) (ms)."""
    stream = compute_stream(acts)
    if stream is None:
        return []
    late = blocked_windows(acts, launches, stream, (comm,), latency=LAUNCH_LATENCY_US)[0]
    now = blocked_windows(acts, launches, stream, (comm,), latency=0.0)[0]
    short = [w for w in now if w[1] - w[0] <= LAUNCH_LATENCY_US]
    less_own = [row["less_own"] for row in per_step_blocked(acts, launches, (comm,))]
    rows = []
    for k, (lo, hi, exposed) in enumerate(step_exposed(acts, (comm,))):

        def inside(windows: list[tuple[float, float]]) -> float:
            merged = _union(_clip(windows, lo, hi))
            return sum(_overlap(a, b, merged) for a, b in exposed) / 1e3

        rows.append(dict(blocked=inside(late), no_latency=inside(now), short=inside(short), less_own=less_own[k],
                         short_n=sum(1 for a, b in _clip(short, lo, hi) if _overlap(a, b, exposed) > 0)))
    return rows


def transitions(acts: list[tuple], launches: dict[int, float], comm: str = "nccl") -> str:
    """Each transition's queued gaps: the median with no collective beside (the part :func:`nccl_truth.own_gaps`
    takes off), and how many gaps a step of the table (from the first marker on) had beside a collective and alone."""
    stream = compute_stream(acts)
    if stream is None:
        return "-"
    gaps = queued_gaps(acts, launches, stream, (comm,))
    own = own_gap_medians(gaps)  # over the whole profile, as own_gaps takes them
    steps = step_exposed(acts, (comm,))
    if not steps:
        return "-"
    first = steps[0][0]  # the profile's steps before the first marker (a prewarm's) are no step of the table's
    counted = [g for g in gaps if g[0] >= first]
    out = []
    for move in sorted({g[2] for g in gaps}):
        beside = sum(1 for g in counted if g[2] == move and g[3]) / len(steps)
        alone = sum(1 for g in counted if g[2] == move and not g[3]) / len(steps)
        med = f"median alone {own[move]:.1f} us" if move in own else "never alone"
        out.append(f"{move[0]}->{move[1]} {med}, {beside:.1f} a step beside a collective, {alone:.1f} alone")
    return "; ".join(out) or "none"


def quantiles(values: list[float]) -> str:
    if len(values) < 10:
        return f"n={len(values)}"
    q = statistics.quantiles(values, n=10)
    return f"n={len(values)} p10 {q[0]:.2f} median {statistics.median(values):.2f} p90 {q[8]:.2f}"


def report(path: str) -> list[str]:
    d = load(path)
    acts = [tuple(a) for a in d["activities"] if a[3] not in ("annotation", "sync")]
    launches = {int(k): v[1] for k, v in d["launches"].items()}
    beside, alone = latencies(acts, launches)
    name = f"{d['case']} rank {d['rank']}"
    lines = [f"{name}: idle-stream launch to start (us), a collective running: {quantiles(beside)}; none: "
             f"{quantiles(alone)}"]
    waits = []
    for k, row in enumerate(per_step(acts, launches)):
        final = d["rows"][k][1] if k < len(d["rows"]) else {}
        wait = sum(final.get(p, 0.0) for p in COMM_PARTS) if final else None
        waits.append((wait, row))
        pt = "-" if wait is None else f"{wait:8.3f}"
        lines.append(f"  {name} step {d['first'] + k}: blocked {row['blocked']:8.3f} (latency {LAUNCH_LATENCY_US:g} "
                     f"us), {row['no_latency']:8.3f} (none), of it {row['short']:6.3f} in {row['short_n']} windows of "
                     f"<= {LAUNCH_LATENCY_US:g} us; less the stream's own gaps {row['less_own']:8.3f}; "
                     f"phase-timer {pt}")
    near = [(within(w, row["blocked"]), within(w, row["less_own"])) for w, row in waits if w is not None]
    if near:
        lines.append(f"  {name}: phase-timer within 0.1 ms or 2% on {sum(a for a, _ in near)}/{len(near)} steps of the "
                     f"blocked rule, {sum(b for _, b in near)}/{len(near)} of it less the stream's own gaps")
    lines.insert(1, f"  {name}: the compute stream's queued gaps by transition: {transitions(acts, launches)}")
    return lines


def main(report: Callable[[str], list[str]] = report) -> None:
    """Each file's ``report`` lines, printed and (``--out``) written: this script's, and ``copies_estimate_ab.py``'s."""
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--out")
    args = p.parse_args()
    text = "\n".join(line for path in args.files for line in report(path))
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
