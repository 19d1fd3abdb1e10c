"""Two ranks under torchrun, each timed, one running out of memory (planted) in its forward.

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/oom_ranks.py --log-dir DIR --oom-at 30

No collective between the ranks (each trains its own model), so that rank zero goes on to its end and
writes its summary: what it must then say is which rank ran out.  The rank that runs out gets the
error back from the timer, unchanged, prints ``RANK<r>OOM`` and ends normally (so that torchrun does
not stop the other rank).  Rank zero prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn

import phase_timer


class Net(nn.Module):
    def __init__(self, oom_at: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.oom_at, self.calls = oom_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.oom_at + 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
        return self.body(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--oom-at", type=int, required=True, help="rank --oom-rank runs out in this step's forward")
    p.add_argument("--oom-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=60, help="steps of the ranks that do not run out")
    p.add_argument("--rank-timeout", type=float, default=2.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = Net(args.oom_at if rank == args.oom_rank else -1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(16, 32), torch.randn(16, 1)) for _ in range(args.steps)]
    timer = phase_timer.attach(model, opt, data, log_dir=args.log_dir, window=5, warmup_steps=2,
                               rank_timeout_s=args.rank_timeout)
    try:
        with timer:
            for x, y in timer.loader:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    except torch.OutOfMemoryError:
        print(f"RANK{rank}OOM", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"log_dir": timer.log_dir, "summary_path": timer.summary_path}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
