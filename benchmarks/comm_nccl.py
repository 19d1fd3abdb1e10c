"""Issue 40: the communication split on two GPUs with NCCL, every rank against the profiler's timeline.

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/comm_nccl.py [--out FILE]
    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/comm_nccl.py --cpu   # gloo: a smoke run

Each case is its own model and ``attach()`` (the plain door), on an LM of residual MLP blocks in bf16 autocast
(``--width 2048 --depth 12``: ~470M parameters, fp32 weights and gradients):

- ``ddp_hide``: DDP with 25 MB buckets, ``gradient_as_bucket_view=True``: the all-reduces start early in
  backward and hide behind the rest of it.
- ``ddp_expose``: the same with one bucket (``bucket_cap_mb`` above the gradients' size): its all-reduce starts
  after backward's last gradient, and is exposed.  ``COMM_BOUND`` is expected here, and not in ``ddp_hide``.
- ``ddp_default``: DDP's defaults (``gradient_as_bucket_view=False``): DDP copies into ``.grad`` inside its
  end-of-backward; phase-timer times those copies on sampled backwards and takes them off the wait (their
  kernels under ``copy_bucket_to_grad`` are listed beside it).
- ``ddp_straggler``: ``ddp_hide`` with rank 1 sleeping 20 ms in every forward: ``RANK_STRAGGLER`` should name
  rank 1 and say rank 0's extra wait is exposed communication waiting for it.
- ``fsdp2``: ``fully_shard`` on every block and the root: forward's and backward's waits.

The truth, per rank and step, is the profiler's union-of-intervals rule on the same timed steps: the NCCL
kernels' time not overlapped by any other kernel (the compute stream's copies count as its work: see
``comm_truth.py``), over the whole step, against ``forward.comm_wait`` + ``backward.comm_wait``; the offline
analyzers' rule (compute kernels only) is listed beside it.  It also counts the host-device syncs in the profiled steps.  Rank zero prints a table
(one row per case and rank), the verdicts, and writes ``--out``.  ``--cpu``: gloo, a tiny model, no profiler:
that the script runs, splits and adds up (``tests/test_comm.py`` runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.comm_truth import timeline  # noqa: E402
from benchmarks.provenance import code_line  # noqa: E402
from phase_timer.metrics import COMM_PARTS, share_base, whole_phases  # noqa: E402

CASES = ("ddp_hide", "ddp_expose", "ddp_default", "ddp_straggler", "fsdp2")
SLOW_S = 0.02


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, depth: int, slow_s: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, vocab)
        self.slow_s = slow_s

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.slow_s:
            time.sleep(self.slow_s)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run(case: str, args: argparse.Namespace, device: torch.device) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = LM(args.vocab, args.width, args.depth, SLOW_S if case == "ddp_straggler" and rank == 1 else 0.0).to(device)
    if case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        model = fully_shard(net)
    else:
        grads_mb = sum(p.numel() for p in net.parameters()) * 4 / 2**20
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=2 * grads_mb if case == "ddp_expose" else 25,
            gradient_as_bucket_view=case != "ddp_default")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(4)]
    data = [data[i % 4] for i in range(args.steps)]
    timer = phase_timer.attach(model, opt, data, log_dir=tempfile.mkdtemp(), window=10, warmup_steps=args.warmup,
                               copy_to_device=True, summary=False)
    prof = None if device.type != "cuda" else torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    for i, tokens in enumerate(timer.loader):
        if i == args.warmup and prof is not None:
            torch.cuda.synchronize()  # the benchmark's: the profiled steps begin on an idle device
            prof.start()
        with autocast:
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if prof is not None:
        torch.cuda.synchronize()  # the benchmark's
        prof.stop()
    totals = timer.close()
    phases = {p: t.mean for p, t in totals.phases.items()}
    inside = [p for p in whole_phases(phases) if share_base(p) == "step" and p != "step"]
    n = args.steps - args.warmup
    nan = float("nan")
    t = (timeline(prof.events(), n, ("nccl",)) if prof is not None
         else dict(exposed=nan, exposed_stream=nan, copies=nan, syncs=0))
    truth, analyzers, copies, syncs = t["exposed_stream"], t["exposed"], t["copies"], t["syncs"]
    d = timer.diagnosis
    kinds = [d.kind, *(f.kind for f in d.secondary)] if d is not None else []
    straggler = next((f for f in [d, *d.secondary] if f.kind == "RANK_STRAGGLER"), None) if d is not None else None
    return dict(case=case, rank=rank, wait=sum(phases.get(p, 0.0) for p in COMM_PARTS),
                forward_wait=phases.get("forward.comm_wait"), backward_wait=phases.get("backward.comm_wait"),
                truth=truth, analyzers=analyzers, copies=copies, syncs=syncs, step=phases.get("step"), kinds=kinds,
                adds_up=abs(sum(phases[p] for p in inside) - phases["step"]) <= 1e-6 * phases["step"],
                straggler=(straggler.why + " | " + " | ".join(straggler.next)) if straggler is not None else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="gloo, a tiny model, no profiler: a smoke run")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out")
    args = p.parse_args()
    if args.cpu:
        args.width, args.depth, args.vocab, args.batch, args.seq = 64, 2, 128, 4, 16
        args.steps, args.warmup = min(args.steps, 12), min(args.warmup, 3)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", device_id=device if device.type == "cuda" else None)
    rows = []
    for case in args.cases.split(","):
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, run(case, args, device))
        rows += every
    if dist.get_rank() == 0:
        lines = [code_line(), f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (gloo)'}; torch "
                 f"{torch.__version__}; world {dist.get_world_size()}; LM width {args.width} x {args.depth} blocks, "
                 f"batch {args.batch} x {args.seq} tokens; {args.steps} steps, the last {args.steps - args.warmup} "
                 f"timed and profiled",
                 f"{'case':14} {'rank':>4} {'comm_wait ms':>12} {'fwd ms':>7} {'bwd ms':>7} {'profiler ms':>11} "
                 f"{'diff ms':>8} {'analyzers ms':>12} {'DDP copies':>10} {'step ms':>8} {'syncs':>5} {'adds up':>7}  "
                 "verdicts"]
        for r in rows:
            f = lambda v: float("nan") if v is None else v  # noqa: E731
            lines.append(f"{r['case']:14} {r['rank']:4d} {r['wait']:12.3f} {f(r['forward_wait']):7.3f} "
                         f"{f(r['backward_wait']):7.3f} {r['truth']:11.3f} {r['wait'] - r['truth']:+8.3f} "
                         f"{r['analyzers']:12.3f} {r['copies']:10.3f} {f(r['step']):8.3f} {r['syncs']:5d} {str(r['adds_up']):>7}  "
                         f"{','.join(r['kinds'])}")
        lines += [f"straggler ({r['case']}, rank {r['rank']}): {r['straggler']}" for r in rows if r["straggler"]]
        print("\n".join(lines), flush=True)
        print("RESULT " + json.dumps(rows), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
