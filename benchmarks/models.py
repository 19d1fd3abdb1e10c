"""The benchmark's models and loops: launch-bound (~2 ms/step) and GPU-bound (>= 8 ms/step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Spec:
    name: str
    width: int
    depth: int
    batch: int


LAUNCH_BOUND = Spec("launch-bound", width=256, depth=5, batch=64)  # small kernels: the GPU waits on Python
GPU_BOUND = Spec("gpu-bound", width=4096, depth=3, batch=2048)  # fp32 GEMMs, ~10 ms


def make_model(spec: Spec, device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(spec.depth):
        layers += [nn.Linear(spec.width, spec.width), nn.GELU()]
    layers.append(nn.Linear(spec.width, 1))
    return nn.Sequential(*layers).to(device)


def make_batches(spec: Spec, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random pinned host batches (never zeros), cycled by the loops."""
    g = torch.Generator().manual_seed(0)
    pin = (lambda t: t.pin_memory()) if torch.cuda.is_available() else (lambda t: t)  # CPU: smoke runs
    return [(pin(torch.randn(spec.batch, spec.width, generator=g)), pin(torch.randn(spec.batch, 1, generator=g))) for _ in range(n)]


class Cycle:
    """An endless loader over a few pinned batches (data loading is not what is measured)."""

    def __init__(self, batches: list[Any], steps: int) -> None:
        self.batches, self.steps = batches, steps

    def __iter__(self):
        for i in range(self.steps):
            yield self.batches[i % len(self.batches)]

    def __len__(self) -> int:
        return self.steps


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> Callable[[Any], None]:
    def step(batch: Any) -> None:
        x, y = batch
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    return step


class Tokens(torch.utils.data.Dataset):
    """``n`` random token sequences of ``seq`` ids below ``vocab`` (seeded by index): ``input_ids`` and ``labels``
    for a 🤗 causal LM, and an all-ones ``attention_mask`` with ``mask``.  No download, the same on every run."""

    def __init__(self, n: int, seq: int, vocab: int = 50257, mask: bool = False) -> None:
        self.n, self.seq, self.vocab, self.mask = n, seq, vocab, mask

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids, **({"attention_mask": torch.ones_like(ids)} if self.mask else {})}

