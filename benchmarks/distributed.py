"""Distributed proof on 2 GPUs or more (NCCL): overhead, added syncs, and the slowed rank named.

    PYTHONPATH=. python benchmarks/distributed.py [--out results.txt] [--pairs 3] [--nproc 2]

Every run is ``torchrun --nproc_per_node NPROC tests/dist_scripts/plain_ddp.py``:

1. Overhead: a GPU-bound DDP model with and without phase-timer, runs interleaved
   (off, on, off, on, ...), ms per step from step 20 to the last step (the steady state),
   median of the per-pair ratios; the end of the run (the timer's close: the final drain,
   rank zero waiting for the ranks' last reports, the files) is timed apart, once a run.
2. Syncs: the profiler's runtime-API trace on both ranks (cudaEventSynchronize,
   cudaStreamSynchronize, cudaDeviceSynchronize, cudaMemcpy) over steady-state
   steps, with and without phase-timer.
3. A slowed rank: rank 1 sleeps 20 ms in each forward; the table of both ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.provenance import code_line  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "plain_ddp.py")
GPU_BOUND = ["--width", "4096", "--depth", "16", "--batch", "512"]


def torchrun(*args: str, nproc: int) -> tuple[dict, dict[str, int] | None]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), SCRIPT, *args]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line][:20]
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n" + "\n".join(errors))
    result, rank1 = None, None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
        elif line.startswith("RANK1SYNCS "):
            rank1 = json.loads(line[11:])
    assert result is not None, proc.stdout[-2000:]
    return result, rank1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs of this host)")
    args = p.parse_args()
    import torch

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(code_line())
    say(f"device: {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
        f"{args.nproc} ranks")
    tmp = tempfile.mkdtemp()
    # 1. overhead, interleaved pairs
    ratios, offs, ons = [], [], []
    for i in range(args.pairs):
        off, _ = torchrun("--log-dir", tmp, "--steps", str(args.steps), "--bench-from", "20", "--no-timer", *GPU_BOUND,
                          nproc=args.nproc)
        on, _ = torchrun("--log-dir", tmp, "--steps", str(args.steps), "--bench-from", "20", *GPU_BOUND, nproc=args.nproc)
        offs.append(off["step_ms"])
        ons.append(on["step_ms"])
        ratios.append(on["step_ms"] / off["step_ms"])
        say(f"pair {i}: no timer {off['step_ms']:.3f} ms/step, phase-timer {on['step_ms']:.3f} ms/step, ratio {ratios[-1]:.4f}; "
            f"the end (after the last step: drain, the ranks' last reports, files) {off['close_ms']:.1f} / {on['close_ms']:.1f} ms")
    overhead = (statistics.median(ratios) - 1) * 100
    # 2. syncs over steady-state steps, both ranks
    syncs = {}
    for label, extra in (("no timer", ["--no-timer"]), ("phase-timer", [])):
        r0, r1 = torchrun("--log-dir", tmp, "--steps", "40", "--profile-syncs", *extra, *GPU_BOUND, nproc=args.nproc)
        syncs[label] = (r0["syncs"], r1)
        say(f"syncs, {label}: rank 0 {r0['syncs']}, rank 1 {r1}")
    # 3. the slowed rank
    slow, _ = torchrun("--log-dir", tmp, "--steps", "43", "--window", "10", "--slow-forward", "0.02", "--width", "1024",
                       nproc=args.nproc)
    say("slowed rank (rank 1 sleeps 20 ms in forward), 1024-wide MLP:")
    say(slow["summary"].split("\n\n")[-1])
    say()
    say("| check | result |")
    say("|---|---|")
    say(f"| GPU-bound DDP step, no timer | {statistics.median(offs):.3f} ms (median of {args.pairs}) |")
    say(f"| GPU-bound DDP step, phase-timer | {statistics.median(ons):.3f} ms |")
    say(f"| overhead (median of per-pair ratios) | {overhead:+.2f}% (pairs: {', '.join(f'{(r - 1) * 100:+.2f}%' for r in ratios)}) |")
    same = all(syncs["no timer"][k] == syncs["phase-timer"][k] for k in (0, 1))
    total = lambda d: sum(d.values()) if d else -1  # noqa: E731
    say(
        f"| sync calls, 27 steady steps, rank 0 / rank 1 | no timer {total(syncs['no timer'][0])} / {total(syncs['no timer'][1])}, "
        f"phase-timer {total(syncs['phase-timer'][0])} / {total(syncs['phase-timer'][1])}: {'equal' if same else 'DIFFERENT'} |"
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
