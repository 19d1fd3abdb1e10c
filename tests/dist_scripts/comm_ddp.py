"""DDP's exposed communication on the CPU (gloo, 2 ranks): planted collectives of known length.

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/comm_ddp.py --log-dir DIR

Each case is its own DDP model, timed by its own ``attach()``:

* ``late``: a comm hook (the user's) whose future completes PLANT_S after the *last* bucket is ready:
  nothing is left to hide it, so backward's exposed wait holds it.
* ``early``: the same PLANT_S on the *first* bucket, and HIDE_S more backward compute after it (a
  sleep in an earlier layer's backward): hidden, the wait is ~0 while the collectives still take PLANT_S.
* ``before``: ``late``'s hook registered before attach(): the wait is split all the same (the collectives
  are not sampled: only a hook registered after attach() runs inside phase-timer's).
* ``average``: no user hook: DDP's own average, no Python call a bucket; the gradients the ranks' mean.
* ``fp16``: DDP's built-in FP16_COMPRESS registered after attach(): composed, the gradients still the mean.
* ``no_sync``: four micro-batches a step, three under ``no_sync()``, PLANT_S on the last bucket: one wait
  a step, not four.

Rank zero prints ``RESULT {json}``: per case the run's totals (mean ms a step) and its sampled communication.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import phase_timer
from phase_timer.measures.comm import run as comm_run

PLANT_S = 0.03
HIDE_S = 0.06
WIDTH = 128


class Delay(torch.autograd.Function):
    """Identity forward; a sleep in backward: compute that runs after the later layers' buckets are ready."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class Net(nn.Module):
    def __init__(self, hide_s: float) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.last = nn.Linear(WIDTH, WIDTH)
        self.hide_s = hide_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.hide_s:
            h = Delay.apply(h, self.hide_s)  # backward: after `last`'s bucket, before `first`'s
        return self.last(torch.relu(h))


def planted(which: str, calls: list[int]):
    """The user's hook: DDP's average (a real all-reduce), then completion PLANT_S after `which` bucket is ready."""

    def hook(state, bucket):  # no annotations: DDP checks them against its own types (strings here)
        calls[0] += 1
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        dist.all_reduce(buf)
        fut: torch.futures.Future = torch.futures.Future()
        delay = PLANT_S if (bucket.is_last() if which == "last" else bucket.index() == 0) else 0.0
        if delay:
            threading.Timer(delay, fut.set_result, (buf,)).start()
        else:
            fut.set_result(buf)
        return fut

    return hook


def run(case: str, log_dir: str, steps: int) -> dict:
    torch.manual_seed(1)
    net = Net(HIDE_S if case == "early" else 0.0)
    # one bucket per layer: `last`'s first (its gradients come first), `first`'s last (DDP closes a bucket
    # once it holds the cap: exactly one layer's weight and bias, or `first`'s bias would join `last`'s bucket)
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=(WIDTH * WIDTH + WIDTH) * 4 / 2**20)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
    rank = dist.get_rank()
    data = [torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank * 1000 + i)) for i in range(steps)]
    calls = [0]
    if case == "before":
        model.register_comm_hook(None, planted("last", calls))
    timer = phase_timer.attach(model, opt, data, log_dir=os.path.join(log_dir, case), window=5, warmup_steps=3)
    if case in ("late", "early", "no_sync"):
        model.register_comm_hook(None, planted("first" if case == "early" else "last", calls))
    elif case == "fp16":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    micro = 4 if case == "no_sync" else 1
    grads_ok = True
    for x in timer.loader:
        for k in range(micro):
            ctx = model.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with ctx:
                model(x).square().mean().backward()
        if case in ("average", "fp16"):  # each rank's gradient is the ranks' mean: the same on both
            g = net.first.weight.grad.detach().clone()
            peers = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(peers, g)
            grads_ok &= all(torch.allclose(p, peers[0], rtol=1e-3, atol=1e-5) for p in peers)
        opt.step()
        opt.zero_grad()
    run_comm = comm_run.find(timer.core)
    totals = timer.close()
    out = {p: t.mean for p, t in totals.phases.items()}
    hooks_left = len(net.first.weight._post_accumulate_grad_hooks or {})  # the model as found, after close()
    return dict(phases=out, comm=run_comm.as_dict(), hook_calls=calls[0], grads_ok=bool(grads_ok),
                steps=totals.steps, hooks_left=hooks_left)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--cases", default="late,early,before,average,fp16,no_sync")
    args = p.parse_args()
    dist.init_process_group("gloo")
    results = {case: run(case, args.log_dir, args.steps) for case in args.cases.split(",")}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
