"""phase-timer with PyTorch Lightning: one callback, nothing else changes.

    python examples/lightning_quickstart.py            # CPU, synthetic data, seconds
    tensorboard --logdir lightning_logs                # then open the SCALARS / CUSTOM SCALARS tabs

Runs on a GPU too when one is there (phases then come from CUDA events).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from phase_timer import PhaseTimer  # <-- phase-timer


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--root", default=".", help="where lightning_logs/ goes")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
    trainer = pl.Trainer(
        max_steps=args.steps,
        log_every_n_steps=20,
        callbacks=[PhaseTimer()],  # <-- phase-timer: the only line it needs
        default_root_dir=args.root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=64, shuffle=True))


if __name__ == "__main__":
    main()
