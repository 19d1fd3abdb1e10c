"""FSDP2's exposed communication on the CPU (gloo, 2 ranks): a planted late rank.

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/comm_fsdp.py --log-dir DIR

Four layers, each its own ``fully_shard`` group, and the root.  Rank 1 sleeps SLOW_S in forward just before
its third layer, so rank 0's all-gather of that layer's parameters completes only SLOW_S later: rank 0's
``forward.comm_wait`` holds it, rank 1's does not.  Backward's reduce-scatters and re-gathers are split into
``backward.comm_wait``.  Rank zero prints ``RESULT {json}``: both ranks' mean ms a step, per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import phase_timer

SLOW_S = 0.03
WIDTH = 128


class Net(nn.Module):
    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.slow_s = slow_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 2 and self.slow_s:
                time.sleep(self.slow_s)
            x = torch.relu(layer(x))
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net(SLOW_S if rank == 1 else 0.0)
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = [torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank * 1000 + i)) for i in range(args.steps)]
    timer = phase_timer.attach(net, opt, data, log_dir=os.path.join(args.log_dir, "fsdp"), window=5, warmup_steps=3)
    for x in timer.loader:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    totals = timer.close()
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    fsdp_fns = (group_mod.foreach_all_gather_copy_out, group_mod.foreach_all_gather, group_mod.foreach_reduce,
                group_mod.FSDPParamGroup.finalize_backward, group_mod.FSDPParamGroup.post_backward)
    ours = os.path.join("phase_timer", "measures", "comm", "fsdp.py")  # FSDP2 as found after close(): none of its functions is ours
    mine = dict(phases={ph: t.mean for ph, t in totals.phases.items()}, steps=totals.steps,
                restored=not any(fn.__code__.co_filename.endswith(ours) for fn in fsdp_fns))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": every}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
