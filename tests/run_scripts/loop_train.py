"""A hand-written training loop with no phase-timer in it (``--by-hand`` attaches itself), for
``tests/cli/test_watch_run.py``: ``phase-timer run`` finds its optimizers and models and times it from its third step.

    python tests/run_scripts/loop_train.py [--steps N] [--gan] [--by-hand] [--hidden] [--cuda]

``--gan``: two models and two optimizers a step (a discriminator's step, then a generator's), as a GAN's loop;
``--hidden``: the model is out of the loop's reach (two dicts down).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def plain(steps: int, by_hand: bool, device: str = "cpu") -> None:
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timer = None
    if by_hand:
        import phase_timer

        timer = phase_timer.attach(model, opt, warmup_steps=2, log_dir="by-hand")
    for _ in range(steps):
        x = torch.randn(64, 16, device=device)  # the loop makes its own batches
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if timer is not None:
        timer.close()


def gan(steps: int) -> None:
    gen, disc = nn.Sequential(nn.Linear(8, 16)), nn.Sequential(nn.Linear(16, 1))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    for _ in range(steps):
        fake = gen(torch.randn(32, 8))
        d_loss = disc(fake.detach()).mean() - disc(torch.randn(32, 16)).mean()
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        g_loss = -disc(gen(torch.randn(32, 8))).mean()
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        disc.zero_grad()


def hidden(steps: int) -> None:
    box = {"inner": {"net": Net()}}  # two levels down: out of the loop's reach
    opt = torch.optim.SGD(box["inner"]["net"].parameters(), lr=1e-3)
    for _ in range(steps):
        box["inner"]["net"](torch.randn(8, 16)).mean().backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--gan", action="store_true")
    parser.add_argument("--by-hand", action="store_true")
    parser.add_argument("--hidden", action="store_true")
    parser.add_argument("--cuda", action="store_true", help="the plain loop on one CUDA device")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.gan:
        gan(args.steps)
    elif args.hidden:
        hidden(args.steps)
    else:
        plain(args.steps, args.by_hand, "cuda" if args.cuda else "cpu")
    print("script: done")


if __name__ == "__main__":
    main()
