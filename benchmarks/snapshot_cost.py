"""What ``memory_snapshot=`` costs a step: the same loop with the allocator's history recorded and without.

    PYTHONPATH=. python benchmarks/snapshot_cost.py [--pairs 3] [--steps 60] [--out FILE]

``memory_truth.py``'s 32k-vocabulary LM (bf16, 8 x 1024 tokens), ``attach()`` with ``memory_snapshot=None``
and ``=True``, interleaved (A B A B ...); each run's time a step is the wall time of its last ``steps - 20``
steps between two ``torch.cuda.synchronize()`` calls (the benchmark's, not the timer's).  Recording keeps a
Python stack for every allocation and free (PyTorch's ``_record_memory_history``), so its cost is the
host's, and shows where the host is the bottleneck: the allocations a step are printed beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.memory_truth import build  # noqa: E402
from benchmarks.provenance import code_line  # noqa: E402


def run(steps: int, snapshot: bool) -> tuple[float, float]:
    model, data, dtype = build("lm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = [data[i % len(data)] for i in range(steps)]
    before = torch.cuda.memory_stats().get("num_alloc_retries", 0), torch.cuda.memory_stats()["allocation.all.allocated"]
    t0 = 0.0
    with phase_timer.attach(model, opt, batches, log_dir=tempfile.mkdtemp(), summary=False,
                            memory_snapshot=True if snapshot else None) as timer:
        for i, (x, y) in enumerate(timer.loader):
            if i == 20:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                allocs0 = torch.cuda.memory_stats()["allocation.all.allocated"]
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=dtype):
                loss = model.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / (steps - 20)
        allocs = (torch.cuda.memory_stats()["allocation.all.allocated"] - allocs0) / (steps - 20)
    del before
    return ms, allocs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out")
    args = ap.parse_args()
    lines = [code_line(), f"device {torch.cuda.get_device_name()}  torch {torch.__version__}; memory_truth's LM, bf16, "
             f"8x1024 tokens; {args.pairs} interleaved pairs, ms a step over steps 21-{args.steps}"]
    off, on, allocs = [], [], []
    for _ in range(args.pairs):
        off.append(run(args.steps, False)[0])
        ms, n = run(args.steps, True)
        on.append(ms)
        allocs.append(n)
    ratios = [b / a - 1 for a, b in zip(off, on)]
    lines.append(f"off {', '.join(f'{x:.2f}' for x in off)} ms; memory_snapshot=True {', '.join(f'{x:.2f}' for x in on)} "
                 f"ms; allocations a step {statistics.median(allocs):.0f}")
    lines.append(f"median cost {statistics.median(ratios):+.2%} ({statistics.median(on) - statistics.median(off):+.3f} ms "
                 f"a step, {(statistics.median(on) - statistics.median(off)) * 1e3 / statistics.median(allocs):.2f} us an "
                 "allocation)")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
