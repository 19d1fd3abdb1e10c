"""phase-timer on a hand-written PyTorch loop: attach once, keep the loop as it is.

    python examples/plain_pytorch.py                   # CPU, or CUDA when present
    tensorboard --logdir phase-timer-logs
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phase_timer  # <-- phase-timer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-dir", default="phase-timer-logs")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8192, 64), torch.randn(8192, 1))
    loader = DataLoader(data, batch_size=64, shuffle=True, pin_memory=device.type == "cuda")
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # <-- phase-timer: one call; the loop iterates timer.loader, everything else is hooks.
    with phase_timer.attach(model, optimizer, loader, copy_to_device=True, log_dir=args.log_dir, window=20) as timer:
        step = 0
        while step < args.steps:
            for x, y in timer.loader:  # <-- phase-timer: the wrapped loader
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                with timer.phase("clip"):  # <-- phase-timer: an explicit phase
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                step += 1
                if step == args.steps:
                    break
    # The table's last line says where the files went; in code: timer.log_dir, timer.summary_path.


if __name__ == "__main__":
    main()
