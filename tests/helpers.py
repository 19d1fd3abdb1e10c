"""Real Lightning pieces for the tests: modules whose phases take known times.

Their planted waits go through :func:`pause`: a real sleep, or under the ``host_hours`` fixture
(``conftest.py``) no sleep at all, the host clock moved an hour per planted millisecond (:class:`HostHours`).
"""

from __future__ import annotations

import glob
import importlib
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")

HOUR_NS = 3_600 * 10**9
HOUR_MS = 3_600_000.0


class HostHours:
    """``time.perf_counter_ns`` (the clock phase-timer reads on the CPU) as the real clock plus hours a test adds.

    A planted wait on it takes no real time, and no load can lengthen, shorten or imitate it: a
    value read back holds :func:`hours` of it planted hours, because the real time in it is a
    test's few minutes at most (its timeout), far from the half hour that would change the
    rounding.  So a test can say exactly where a wait landed, and that it landed nowhere else,
    on a busy 2-core runner as on an idle one.
    """

    def __init__(self) -> None:
        self._real = time.perf_counter_ns
        self.offset_ns = 0

    def __call__(self) -> int:
        return self._real() + self.offset_ns

    def jump(self, hours: float = 1.0) -> None:
        """The host clock ``hours`` on, at once."""
        self.offset_ns += round(hours * HOUR_NS)


class CallInBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn()`` first: a known amount of backward time, where a test plants it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any) -> torch.Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fn()
        return grad, None


def hours(ms: float) -> int:
    """The whole planted hours in a value in ms read back from a run on :class:`HostHours`."""
    return round(ms / HOUR_MS)


def hours_per_step(totals: Any) -> dict[str, int | tuple[int, int]]:
    """Each phase's planted hours in every timed step of a run's totals: ``n``, or ``(fewest, most)`` where
    the steps differ."""
    out: dict[str, int | tuple[int, int]] = {}
    for phase, t in totals.phases.items():
        lo, hi = hours(t.min), hours(t.max)
        out[phase] = lo if lo == hi else (lo, hi)
    return out


def pause(seconds: float) -> None:
    """A planted wait: a real sleep (``host_hours`` makes it ``1000 * seconds`` hours of the host clock instead)."""
    time.sleep(seconds)


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run directory, read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_files(log_dir: str) -> list[str]:
    return glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)


def open_files_under(path: str) -> list[str]:
    """Files under ``path`` that this process still holds open (from /proc)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.realpath(path)):
            out.append(target)
    return out


class SleepyData(Dataset):
    """Random regression data, ``width`` features; each item takes ``sleep_s`` to load."""

    def __init__(self, n: int = 4096, sleep_s: float = 0.0, width: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            pause(self.sleep_s)
        return self.x[i], self.y[i]


def slow_backward(x: torch.Tensor, sleep_s: float) -> torch.Tensor:
    """``x``, whose backward takes ``sleep_s`` (:func:`pause`): a known amount of backward time."""
    return CallInBackward.apply(x, lambda: pause(sleep_s))


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes ``sleep_s`` longer."""

    def __init__(self, params: Any, lr: float, sleep_s: float = 0.0) -> None:
        super().__init__(params, lr=lr)
        self.sleep_s = sleep_s

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        pause(self.sleep_s)
        return out


def loader(batch_size: int = 8, sleep_s: float = 0.0, n: int = 4096) -> DataLoader:
    return DataLoader(SleepyData(n, sleep_s), batch_size=batch_size)


def module_class(ns: str) -> type:
    """A LightningModule of namespace ``ns`` with a sleep in each phase."""
    pl = importlib.import_module(ns)

    class Sleepy(pl.LightningModule):
        def __init__(
            self,
            *,
            h2d: float = 0.0,
            forward: float = 0.0,
            backward: float = 0.0,
            optimizer: float = 0.0,
            val: float = 0.0,
            manual: int = 0,
            fail_at: int | None = None,
            fail_with: type[BaseException] = RuntimeError,
        ) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
            self.sleeps = {"h2d": h2d, "forward": forward, "backward": backward, "optimizer": optimizer, "val": val}
            self.automatic_optimization = manual == 0
            self.n_optimizers = max(1, manual)
            self.fail_at = fail_at
            self.fail_with = fail_with

        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            if self.trainer.training:
                pause(self.sleeps["h2d"])
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def _loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            pause(self.sleeps["forward"])
            out = slow_backward(self.net(x), self.sleeps["backward"])
            return nn.functional.mse_loss(out, y)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.fail_at is not None and self.global_step >= self.fail_at:
                raise self.fail_with("planted failure")
            if self.automatic_optimization:
                loss = self._loss(batch)
                self.log("train_loss", loss)
                return loss
            for opt in self.optimizers() if self.n_optimizers > 1 else [self.optimizers()]:
                opt.zero_grad()
                loss = self._loss(batch)
                self.manual_backward(loss)
                opt.step()
            self.log("train_loss", loss)
            return None

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pause(self.sleeps["val"])
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self) -> Any:
            opts = [SlowSGD(self.parameters(), lr=0.01, sleep_s=self.sleeps["optimizer"]) for _ in range(self.n_optimizers)]
            return opts if len(opts) > 1 else opts[0]

    return Sleepy


def trainer(ns: str, root: str, callbacks: list, **kwargs: Any) -> Any:
    pl = importlib.import_module(ns)
    kwargs.setdefault("logger", pl.loggers.TensorBoardLogger(root, name="logs"))
    return pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        num_sanity_val_steps=kwargs.pop("num_sanity_val_steps", 0),
        **kwargs,
    )
