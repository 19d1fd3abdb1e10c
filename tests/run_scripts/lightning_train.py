"""A small Lightning script with no phase-timer in it (``--by-hand`` passes the callback itself), for
``tests/cli/test_watch_run.py``: ``phase-timer run`` on it must write what the callback passed by hand writes.

    python tests/run_scripts/lightning_train.py ROOT [--steps N] [--by-hand] [--fail] [--sleep-ms MS] [--gpu] [--ddp]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl


class Regressor(pl.LightningModule):
    def __init__(self, sleep_ms: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.sleep_ms = sleep_ms

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.sleep_ms / 1e3)  # a slower step, for a run watched while it trains
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--by-hand", action="store_true")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="one CUDA device (tests/test_gpu_watch.py)")
    parser.add_argument("--ddp", action="store_true", help="two CPU processes (gloo), Lightning's own launcher")
    args = parser.parse_args()
    torch.manual_seed(0)
    callbacks = []
    if args.by_hand:
        from phase_timer import PhaseTimer

        callbacks.append(PhaseTimer(warmup_steps=2))
    trainer = pl.Trainer(max_steps=args.steps, log_every_n_steps=10, callbacks=callbacks, default_root_dir=args.root,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="gpu" if args.gpu else "cpu", devices=2 if args.ddp else 1,
                         **({"strategy": "ddp"} if args.ddp else {}))
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer.fit(Regressor(args.sleep_ms), DataLoader(data, batch_size=8))
    print("script: done")
    if args.fail:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
