"""Recorded runs: what phase-timer writes for fixed inputs, kept so that a change of its insides can show it
changes none of its outputs (issue 49: the same numbers on a fixed run, before and after).

    python -m tests.golden_runs --update      # record them again (tests/golden/<run>.json)
    python -m tests.golden_runs --diff RUN    # what differs from the record, field by field

Each run trains on the CPU with the host clock phase-timer reads (``time.perf_counter_ns``) replaced by a virtual
one that moves only where the run plants time: the loader, forward, backward, the optimizer, a custom phase.  So
every figure is exact on any machine and under any load, and the verdict's sampled steps are drawn from a seeded
generator.  What a run writes is kept whole: the summary file, every TensorBoard scalar (read back with
tensorboard's reader) and the table, less what depends on the machine and not on phase-timer (versions, paths,
times of day, the process's CPU use and core count).  ``tests/stories/test_golden.py`` compares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers import CallInBackward, read_scalars

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


class VirtualClock:
    """Nanoseconds that move only by :meth:`plant`."""

    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now

    def plant(self, ms: float) -> None:
        self.now += round(ms * 1e6)


@contextlib.contextmanager
def virtual_time() -> Iterator[VirtualClock]:
    """``time.perf_counter_ns`` on a :class:`VirtualClock`, and phase-timer's sampling generator seeded."""
    import phase_timer.run.boundaries as boundaries

    clock = VirtualClock()
    saved_clock, saved_random = time.perf_counter_ns, boundaries.random
    time.perf_counter_ns = clock
    boundaries.random = types.SimpleNamespace(Random=lambda *a: random.Random(20261126))
    try:
        yield clock
    finally:
        time.perf_counter_ns, boundaries.random = saved_clock, saved_random


class Net(nn.Module):
    """A small MLP whose forward plants ``forward_ms`` and whose backward plants ``backward_ms``."""

    def __init__(self, clock: VirtualClock, forward_ms: float = 2.0, backward_ms: float = 3.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.clock, self.forward_ms, self.backward_ms = clock, forward_ms, backward_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.plant(self.forward_ms)
        return CallInBackward.apply(self.net(x), lambda: self.clock.plant(self.backward_ms))


class Data(Dataset):
    """64 fixed samples; each item plants ``item_ms`` (the loader's time)."""

    def __init__(self, clock: VirtualClock, item_ms: float = 0.125) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
        self.clock, self.item_ms = clock, item_ms

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.clock.plant(self.item_ms)
        return self.x[i], self.y[i]


def _sgd(params: Any, clock: VirtualClock, ms: float = 1.0) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(params, lr=0.01)
    opt.register_step_pre_hook(lambda *_: clock.plant(ms))
    return opt


def plain(tmp: str, clock: VirtualClock) -> Any:
    """The plain door: a loader, 40 steps of 4 samples, a custom phase inside the step and one after it."""
    import phase_timer

    model = Net(clock)
    opt = _sgd(model.parameters(), clock)
    loader = DataLoader(Data(clock), batch_size=4)
    with phase_timer.attach(model, opt, loader, log_dir=tmp, warmup_steps=2, window=10, modules=True) as timer:
        for epoch in range(3):
            for x, y in timer.loader:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                with timer.phase("clip"):
                    clock.plant(0.5)
                opt.step()
                opt.zero_grad()
                with timer.phase("ema"):
                    clock.plant(0.25)
    return timer


def plain_accumulated(tmp: str, clock: VirtualClock) -> Any:
    """The plain door without a loader (the loop makes its batches), 2 micro-batches a step, per-step values."""
    import phase_timer

    model = Net(clock, forward_ms=1.5, backward_ms=2.5)
    opt = _sgd(model.parameters(), clock, ms=0.75)
    data = Data(clock)
    timer = phase_timer.attach(model, opt, log_dir=tmp, warmup_steps=1, window=8, per_step=True, modules=True)
    for step in range(30):
        for micro in range(2):
            i = (4 * (2 * step + micro)) % 64
            batch = [data[j] for j in range(i, i + 4)]
            x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    timer.close()
    return timer


def lightning(tmp: str, clock: VirtualClock) -> Any:
    """The Lightning door: 30 steps, a validation every 10."""
    import lightning.pytorch as pl

    from phase_timer import PhaseTimer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net(clock)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            clock.plant(7.0)  # evaluation: out of every step and period

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _sgd(self.parameters(), clock)

    timer = PhaseTimer(log_every_n_steps=10, warmup_steps=2, modules=True)
    trainer = pl.Trainer(default_root_dir=tmp, max_steps=30, val_check_interval=10, limit_val_batches=1,
                         num_sanity_val_steps=0, callbacks=[timer], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
                         log_every_n_steps=10, logger=pl.loggers.TensorBoardLogger(tmp, name="logs"))
    trainer.fit(Module(), DataLoader(Data(clock), batch_size=4), DataLoader(Data(clock), batch_size=4))
    return timer


def transformers(tmp: str, clock: VirtualClock) -> Any:
    """The 🤗 door: a Trainer over a module of its own (forward, backward and the optimizer planted), 30 steps,
    2 micro-batches a step, windows of 10."""
    from transformers import Trainer, TrainingArguments

    from phase_timer import PhaseTimerCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(clock, forward_ms=1.0, backward_ms=1.5)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    class Items(Data):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
            x, y = super().__getitem__(i)
            return {"x": x, "labels": y}

    model = Model()
    callback = PhaseTimerCallback(warmup_steps=2, modules=True)
    args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=30, logging_steps=10, use_cpu=True, disable_tqdm=True, report_to="none",
                             save_strategy="no", dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Items(clock, item_ms=0.03125), callbacks=[callback],
            optimizers=(_sgd(model.parameters(), clock, ms=0.5), None)).train()
    return callback.timer


RUNS: dict[str, Callable[[str, VirtualClock], Any]] = {
    "plain": plain, "plain_accumulated": plain_accumulated, "lightning": lightning, "transformers": transformers}

#: Summary-file fields that describe the machine or the moment, not phase-timer's measure of the run.
_MACHINE = {"written_at", "log_dir", "python", "torch", "cuda", "device", "lightning", "transformers", "accelerate"}


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in _MACHINE}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, float):
        return round(value, 9)
    return value


def record(name: str) -> dict:
    """One run's outputs, as :func:`_scrub` keeps them."""
    with tempfile.TemporaryDirectory() as tmp, virtual_time() as clock:
        timer = RUNS[name](tmp, clock)
        summary_path = timer.summary_path
        with open(summary_path) as fh:
            summary = json.load(fh)
        scalars = read_scalars(timer.log_dir)
        table = (timer.last_summary or "").replace(tmp, "<log_dir>")
    out = {"summary": _scrub(summary), "table": table,
           "scalars": {tag: [[s, round(v, 6)] for s, v in points] for tag, points in sorted(scalars.items())
                       if tag.startswith(("phase_", "throughput/"))}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--update", action="store_true")
    p.add_argument("--diff")
    args = p.parse_args()
    if args.update:
        os.makedirs(GOLDEN, exist_ok=True)
        for name in RUNS:
            with open(os.path.join(GOLDEN, f"{name}.json"), "w") as fh:
                json.dump(record(name), fh, indent=1, sort_keys=True)
                fh.write("\n")
            print("recorded", name)
    if args.diff:
        with open(os.path.join(GOLDEN, f"{args.diff}.json")) as fh:
            want = json.load(fh)
        got = json.loads(json.dumps(record(args.diff), sort_keys=True))
        for line in differences(want, got):
            print(line)


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """Each place where ``got`` differs from ``want``, as ``path: want -> got``."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            if k not in got or k not in want:
                out.append(f"{path}/{k}: {want.get(k, '<absent>')!r:.80} -> {got.get(k, '<absent>')!r:.80}")
            else:
                out += differences(want[k], got[k], f"{path}/{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {want!r:.80} -> {got!r:.80}"]


if __name__ == "__main__":
    main()
