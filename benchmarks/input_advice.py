"""INPUT_BOUND's advice, applied to planted loaders: the figures behind ``tests/diagnosis/test_input_advice.py`` (issue 36).

The tests' own scenarios (their loaders and loop, ``tests/diagnosis/test_input_advice.py``): each planted loader runs once
for its advice, then as it was and as advised, interleaved ``--pairs`` times; each run's median ``period`` is
printed, and the training thread's share queued for a core in the runs without workers (at 10% or more the tests
skip the comparison: other processes were taking the cores).

    python benchmarks/input_advice.py --pairs 3 --out benchmarks/results/input_advice_cpu.txt
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.provenance import code_line  # noqa: E402

CASES = ("cpu", "io", "cheap", "cheap_workers")


def _case(name: str):
    """(dataset maker, batch size, the run as it was: loader arguments, how the advice is applied)."""
    import torch
    from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset

    from tests.diagnosis.test_input_advice import STEPS, CpuItems, SleepyItems

    if name == "cpu":
        return (lambda: CpuItems(8 * (STEPS + 1), 1000.0)), 8, {}, "workers"
    if name == "io":
        return (lambda: SleepyItems(8 * (STEPS + 1), 1000.0)), 8, {}, "workers"
    n = 64 * (STEPS + 1)
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
    if name == "cheap":
        batched = {"sampler": BatchSampler(SequentialSampler(data), 64, drop_last=False), "batch_size": None}
        return (lambda: data), 64, {}, batched
    return (lambda: data), 64, {"num_workers": 2}, "workers"


def run_case(name: str, pairs: int, tmp: pathlib.Path) -> list[str]:
    from tests.diagnosis.test_input_advice import _period, _queued, _run

    make, bs, was, apply = _case(name)
    d = _run(tmp / f"{name}-first", make(), bs, **was).diagnosis
    ev = d.evidence
    lines = [f"{name}: {d.kind}, finding {ev.get('finding')}, estimate {ev.get('estimate')}", f"  next: {d.next[0]}"]
    if apply == "workers":
        n = (ev.get("estimate") or {}).get("num_workers")
        if n is None:
            return lines + ["  no worker count advised: nothing to apply"]
        advised = {"batch_size": bs, "num_workers": n}
    else:
        advised = apply
    before, after, queued = [], [], []
    for i in range(pairs):
        t0 = _run(tmp / f"{name}-b{i}", make(), bs, **was)
        t1 = _run(tmp / f"{name}-a{i}", make(), **advised)
        before.append(_period(t0))
        after.append(_period(t1))
        queued.append(_queued(t1 if was.get("num_workers") else t0))  # the run without workers
    lines.append(f"  period p50 as it was: {', '.join(f'{x:.2f}' for x in before)} ms; as advised: "
                 f"{', '.join(f'{x:.2f}' for x in after)} ms; medians {statistics.median(before):.2f} -> "
                 f"{statistics.median(after):.2f} ms; queued for a core without workers: "
                 f"{', '.join(f'{100 * q:.0f}%' for q in queued)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--note", default="", help="a line for the file: how the machine was shared, say")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # torch's note on more workers than cores: the advice means it
    lines = [code_line(), f"tests/diagnosis/test_input_advice.py's planted loaders, {os.cpu_count()} cores, {args.pairs} "
             "interleaved pairs each", *([args.note] if args.note else []), ""]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            for line in run_case(name, args.pairs, pathlib.Path(tmp)):
                lines.append(line)
                print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
