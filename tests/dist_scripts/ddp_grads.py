"""DDP's gradients with phase-timer's copy sampling on every synced backward, against DDP without phase-timer
(gloo, 2 ranks): watching and marking DDP's copies into ``.grad`` must change no gradient.

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/ddp_grads.py

Cases, each a pair of identical models (one timed, one not) fed the same batches:

* ``unused``: ``find_unused_parameters=True``, a layer rank 0 skips and rank 1 uses: DDP copies its used map to
  the host and reads it at once in its end-of-backward (a copy held back there would mark the layer unused).
* ``static``: ``static_graph=True``.
* ``static_unused``: ``static_graph=True``, a layer rank 0 skips: DDP reads its map in the first backward alone,
  outside the span, so the copies are timed on both ranks.
* ``two``: two DDP modules in one backward, both sampled on the same backwards.
* ``view``: ``gradient_as_bucket_view=True``; ``default``: DDP's defaults.

Rank zero prints ``RESULT {json}``: per case, the steps whose gradients matched exactly on both ranks, and the
copies sampled.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import phase_timer
from phase_timer.measures import comm

STEPS = 8


class Net(nn.Module):
    def __init__(self, skip_on: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.skip_on = skip_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.skip_on != dist.get_rank():
            h = torch.relu(self.b(h))
        return self.c(h)


def wrap(case: str) -> list[nn.Module]:
    kw = {"find_unused_parameters": case == "unused", "static_graph": case in ("static", "static_unused"),
          "gradient_as_bucket_view": case == "view", "bucket_cap_mb": 0.001}  # a bucket or so a layer
    nets = [Net(0 if case in ("unused", "static_unused") else None)] + ([Net(None)] if case == "two" else [])
    return [nn.parallel.DistributedDataParallel(n, **kw) for n in nets]


def every_backward_sampled(timer: object) -> None:
    for probe in getattr(timer, "_comm", ()):
        if isinstance(probe, comm.DdpComm) and not probe._untimeable():
            probe._schedule(1)
            probe._schedule = lambda due, p=probe: comm.DdpComm._schedule(p, 1)  # type: ignore[method-assign]


def run(case: str) -> dict:
    rank = dist.get_rank()
    timed, plain = wrap(case), wrap(case)
    opts = [torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1) for ms in (timed, plain)]
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(8, 16, generator=g) for _ in range(STEPS)]
    timer = phase_timer.attach(timed, opts[0], data, log_dir=tempfile.mkdtemp(), warmup_steps=1, window=4,
                               summary=False)
    every_backward_sampled(timer)
    same = 0
    for x in timer.loader:
        for models, opt in zip((timed, plain), opts):
            sum(m(x).square().mean() for m in models).backward()
        grads = [[p.grad for m in ms for p in m.parameters()] for ms in (timed, plain)]
        same += all(a is not None and b is not None and torch.equal(a, b) or a is None and b is None
                    for a, b in zip(*grads))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    sampled = sum(p._copy_taken for p in getattr(timer, "_comm", ()) if isinstance(p, comm.DdpComm))
    timer.close()
    return {"case": case, "rank": rank, "same": same, "steps": STEPS, "sampled": sampled}


def main() -> None:
    dist.init_process_group("gloo")
    out = []
    for case in ("unused", "static", "static_unused", "two", "view", "default"):
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, run(case))
        out += every
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
