"""Lightning with a distributed strategy and PhaseTimer; used by the distributed tests.

    python tests/dist_scripts/lightning_ddp.py --root DIR --strategy ddp        # CPU: gloo, 2 processes
    python tests/dist_scripts/lightning_ddp.py --root DIR --strategy fsdp       # 2 GPUs

One rank can be slowed on purpose: a sleep per item in its data loading
(``--slow-data``) or in its training_step (``--slow-forward``).  ``--plant-late S``: the module registers a comm
hook at ``on_fit_start`` (after the strategy wrapped it in DDP, before any callback's ``on_train_start``:
where DDPStrategy's ``ddp_comm_hook`` goes on a GPU; on a CPU Lightning ignores that argument): DDP's
average, the last bucket's future completed S seconds late (a collective nothing can hide).  Rank zero prints a last line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover
    import pytorch_lightning as pl  # type: ignore[no-redef]

from phase_timer import PhaseTimer


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Data(Dataset):
    def __init__(self, n: int, slow_rank: int, sleep_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randn(n, 1, generator=g)
        self.slow_rank, self.sleep_s = slow_rank, sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s and _rank() == self.slow_rank:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


class Model(pl.LightningModule):
    def __init__(self, width: int, slow_rank: int, forward_sleep_s: float, fail_at: int = 0, late_s: float = 0.0) -> None:
        super().__init__()
        self.fail_at, self.late_s = fail_at, late_s
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.slow_rank, self.forward_sleep_s = slow_rank, forward_sleep_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at and self.global_step == self.fail_at and self.global_rank == self.slow_rank:
            raise RuntimeError(f"planted failure on rank {self.global_rank}")
        if self.forward_sleep_s and self.global_rank == self.slow_rank:
            time.sleep(self.forward_sleep_s)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_fit_start(self) -> None:
        if self.late_s:
            self.trainer.strategy.model.register_comm_hook(None, late_hook(self.late_s))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def late_hook(seconds: float) -> Any:
    """The user's comm hook: DDP's average, the last bucket's future completed ``seconds`` late."""
    import threading

    def planted_late_hook(state, bucket):  # no annotations: DDP checks them against its own types
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        dist.all_reduce(buf)
        fut: torch.futures.Future = torch.futures.Future()
        if bucket.is_last():
            threading.Timer(seconds, fut.set_result, (buf,)).start()
        else:
            fut.set_result(buf)
        return fut

    return planted_late_hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=23)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-data", type=float, default=0.0)
    p.add_argument("--slow-forward", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--fail-at", type=int, default=0, help="the slow rank raises at this step")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--plant-late", type=float, default=0.0)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    timer = PhaseTimer(log_every_n_steps=args.window, warmup_steps=2)
    trainer = pl.Trainer(
        default_root_dir=args.root,
        accelerator="gpu" if cuda else "cpu",
        devices=2,
        strategy=args.strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=args.window,
        logger=pl.loggers.TensorBoardLogger(args.root, name="logs"),
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    data = Data(4096, args.slow_rank, args.slow_data)
    model = Model(args.width, args.slow_rank, args.slow_forward, args.fail_at, args.plant_late)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    if trainer.is_global_zero and args.strategy != "ddp_spawn":
        phases = {p: t.mean for p, t in timer.totals.phases.items()}
        print("RESULT " + json.dumps({"log_dir": timer.log_dir, "summary": timer.last_summary, "steps": trainer.global_step,
                                      "phases": phases, "summary_path": timer.summary_path}), flush=True)
    if args.strategy == "ddp_spawn":  # the main process, after the workers: where they wrote
        import os

        runs = sorted(os.listdir(os.path.join(args.root, "logs")))
        print("RESULT " + json.dumps({"log_dir": os.path.join(args.root, "logs", runs[-1]), "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
