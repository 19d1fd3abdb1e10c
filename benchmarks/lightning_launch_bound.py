"""The Lightning door's overhead on the launch-bound model, resolved finely enough to read 1%.

    PYTHONPATH=. python benchmarks/lightning_launch_bound.py [--rounds 200] [--block 50] [--out FILE]

The same method as ``launch_bound.py`` (the plain door), inside one ``fit``: every
round runs one block of ``--block`` steps of every variant in a shuffled order, and
each variant's overhead is the median over rounds of its block time over the plain
block of the same round.  Long A/B runs of separate Trainers cannot read 1% on a
launch-bound loop (the host's speed drifts by more than that over seconds).

Variants are switched between blocks by the LightningModule's own
``on_train_batch_end``, which Lightning calls after the callbacks' loop, so the
callback list is never changed while Lightning iterates it:

* ``none``: the Trainer with its logger and nothing else;
* ``empty Callback``: a Callback that overrides nothing: what Lightning's dispatch
  costs for any extra callback (it calls every hook of every callback);
* ``PhaseTimer``: phase-timer at default settings (its ``batch_to_device`` wrapper,
  its fetch hooks and its optimizer step hooks in place for its blocks only);
* ``python burn``: plain Python of a known hot cost per step (calibration).

Blocks are 50 steps, the logging window, so every PhaseTimer block pays one window
write.  A second, short fit measures the host time spent *inside* PhaseTimer's hooks
in-situ (each hook body timed with ``perf_counter_ns``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402

import phase_timer  # noqa: E402
from benchmarks.host_cost import print_and_save  # noqa: E402
from benchmarks.launch_bound import Inside, calibrated_burn, overhead_table, sync  # noqa: E402
from benchmarks.models import LAUNCH_BOUND, Cycle, make_batches, make_model  # noqa: E402

CUDA = torch.cuda.is_available()  # CPU: a smoke run only
_HOOKS = ("on_before_backward", "on_after_backward", "on_train_batch_end")
_FETCH_HOOKS = ("_on_before_fetch", "_on_after_fetch")


class Blocks:
    """Which variant runs now, and the time of every finished block."""

    def __init__(self, names: list[str], rounds: int, warmup_rounds: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.order: list[str] = []
        for _ in range(warmup_rounds + rounds):
            names = names[:]
            rng.shuffle(names)
            self.order += names
        self.skip = warmup_rounds * len(names)
        self.us: dict[str, list[float]] = defaultdict(list)
        self.index = 0
        self.t0 = 0

    @property
    def current(self) -> str:
        return self.order[min(self.index, len(self.order) - 1)]

    def block_done(self, steps: int) -> None:
        sync()  # benchmark boundary, between blocks, in every variant alike
        now = time.perf_counter_ns()
        if self.index >= self.skip:
            self.us[self.current].append((now - self.t0) / steps / 1e3)
        self.t0 = now
        self.index += 1


class LaunchBound(pl.LightningModule):
    """The launch-bound MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(LAUNCH_BOUND, torch.device("cpu"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class Switching(LaunchBound):
    """The same, switching the variant between blocks (and burning host time in the calibration's)."""

    def __init__(self, blocks: Blocks, block: int, switch: Any) -> None:
        super().__init__()
        self.blocks, self.block, self.switch = blocks, block, switch
        self.burn: Any = None
        self.n = 0

    def on_train_start(self) -> None:
        self.switch(self.trainer, self.blocks.current)
        sync()
        self.blocks.t0 = time.perf_counter_ns()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.burn is not None:  # the calibration variant
            self.burn()
        self.n += 1
        if self.n % self.block == 0:
            self.blocks.block_done(self.block)
            self.switch(self.trainer, self.blocks.current)

    def on_train_end(self) -> None:
        self.switch(self.trainer, "PhaseTimer")  # so its teardown flushes and closes its files


def trainer(steps: int, callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cuda" if CUDA else "cpu", devices=1, max_steps=steps,
        logger=pl.loggers.TensorBoardLogger(tempfile.mkdtemp()), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=50,
    )


def overhead(rounds: int, block: int, warmup_rounds: int) -> tuple[list[str], dict[str, list[float]]]:
    burn, burn_us = calibrated_burn(10.0)
    burn_name = f"python burn {burn_us:.1f} us"
    timer = phase_timer.PhaseTimer(summary=False)
    empty = pl.Callback()
    names = ["none", "empty Callback", "PhaseTimer (default)", burn_name]
    blocks = Blocks(names, rounds, warmup_rounds)
    # PhaseTimer's pieces outside the callback list, taken at the first switch (after its
    # on_train_start): its batch_to_device wrapper, the fetch hooks it gave the data
    # fetcher, and its optimizer step hooks; and what runs there without it.
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}

    def switch(tr: pl.Trainer, variant: str) -> None:
        strategy, fetcher, opt = tr.strategy, tr.fit_loop._data_fetcher, tr.optimizers[0]
        if not ours:
            ours.update(batch_to_device=strategy.__dict__["batch_to_device"], start=fetcher._start_profiler,
                        stop=fetcher._stop_profiler, pre=dict(opt._optimizer_step_pre_hooks),
                        post=dict(opt._optimizer_step_post_hooks))
            loop = tr.fit_loop.epoch_loop
            theirs.update(start=type(loop)._on_before_fetch.__get__(loop), stop=type(loop)._on_after_fetch.__get__(loop))
        for cb in (timer, empty):
            if cb in tr.callbacks:
                tr.callbacks.remove(cb)
        strategy.__dict__.pop("batch_to_device", None)
        on = variant.startswith("PhaseTimer")
        side = ours if on else theirs
        fetcher._start_profiler, fetcher._stop_profiler = side["start"], side["stop"]
        for hooks, key in ((opt._optimizer_step_pre_hooks, "pre"), (opt._optimizer_step_post_hooks, "post")):
            hooks.clear()
            hooks.update(ours[key] if on else {})
        if on:
            tr.callbacks.append(timer)
            strategy.batch_to_device = ours["batch_to_device"]
        elif variant == "empty Callback":
            tr.callbacks.append(empty)
        net.burn = burn if variant == burn_name else None

    net = Switching(blocks, block, switch)
    steps = len(blocks.order) * block
    torch.manual_seed(0)
    trainer(steps, [timer]).fit(net, Cycle(make_batches(LAUNCH_BOUND), steps))
    # The switching works: the timer timed exactly its own blocks' steps, less its warm-up.
    own = blocks.order.count("PhaseTimer (default)") * block - timer.config.warmup_steps
    assert timer.totals is not None and timer.totals.steps == own, (timer.totals and timer.totals.steps, own)
    return names, blocks.us


class SelfTimed(phase_timer.PhaseTimer):
    """PhaseTimer with its per-step hook bodies and its batch_to_device wrapper timed."""

    def __init__(self, parts: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inside = Inside()
        self.parts = parts

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        copy = Inside()  # Lightning's own copy, which PhaseTimer wraps: not ours
        strategy.batch_to_device = copy.wrap(strategy.batch_to_device, "copy")
        loop = trainer.fit_loop.epoch_loop
        theirs = Inside()  # Lightning's own fetch hooks (its profiler's calls), which ours call: not ours either
        timed_theirs = {}
        for name in _FETCH_HOOKS:
            if callable(getattr(loop, name, None)):
                timed_theirs[name] = theirs.wrap(getattr(loop, name), name)
                setattr(loop, name, timed_theirs[name])
        super().setup(trainer, pl_module, stage)
        wrapped = strategy.batch_to_device

        def batch_to_device(*args: Any, **kwargs: Any) -> Any:
            copy.ns["copy"] = 0
            t0 = time.perf_counter_ns()
            out = wrapped(*args, **kwargs)
            self.inside.ns["batch_to_device wrapper"] += time.perf_counter_ns() - t0 - copy.ns["copy"]
            self.inside.calls["batch_to_device wrapper"] += 1
            return out

        strategy.batch_to_device = batch_to_device
        for name in _HOOKS:
            setattr(self, name, self.inside.wrap(getattr(self, name), name))
        for name in _FETCH_HOOKS:  # ours, around Lightning's own (a profiler call that does nothing): its time apart
            ours = loop.__dict__.get(name)
            if ours is not None and ours is not timed_theirs.get(name):
                setattr(loop, name, self._fetch_hook(ours, name, theirs))

    def _fetch_hook(self, ours: Any, name: str, theirs: Inside) -> Any:
        """Our fetch hook, timed less the Lightning hook it calls (counted apart, as not ours)."""
        inside, key = self.inside, f"fetch hook {name}"

        def timed() -> Any:
            before = theirs.ns[name]
            t0 = time.perf_counter_ns()
            try:
                return ours()
            finally:
                own = theirs.ns[name] - before
                inside.ns[key] += time.perf_counter_ns() - t0 - own
                inside.calls[key] += 1
                inside.excluded[f"Lightning's own {name} (our fetch hook calls it)"] += own

        return timed

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bounds = self._bounds
        if self.parts:
            self.inside.parts(bounds.core, bounds)
        step_end = bounds.on_step_end if hasattr(bounds, "on_step_end") else bounds.step_end  # the older tree's
        timed = self.inside.wrap(step_end, "step end (optimizer post-hook)")
        if hasattr(bounds, "on_step_end"):
            bounds.on_step_end = timed
        else:
            bounds.step_end = timed


def host_inside(steps: int, parts: bool = False, calibrate: bool = False) -> Inside:
    """Host time inside PhaseTimer's per-step hooks, in a real fit (``parts``: the engine's calls timed too;
    ``calibrate``: the timing wrapper's own cost measured too, around an empty forward pre-hook)."""
    timer = SelfTimed(parts=parts, summary=False)
    model = LaunchBound()
    done = timer.inside.calibrate(model.net) if calibrate else None
    trainer(steps, [timer]).fit(model, Cycle(make_batches(LAUNCH_BOUND), steps))
    assert timer.totals is not None and timer.totals.steps == steps - timer.config.warmup_steps
    if done is not None:
        done()
    return timer.inside


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--block", type=int, default=50, help="steps per block (the logging window: 50)")
    ap.add_argument("--warmup-rounds", type=int, default=3)
    ap.add_argument("--inside-steps", type=int, default=3000)
    ap.add_argument("--parts", action="store_true", help="also time the engine's calls inside the hooks (a second fit)")
    ap.add_argument("--calibrate", action="store_true",
                    help="the in-hook fit also times an empty forward pre-hook with the same wrapper (its own cost)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names, us = overhead(args.rounds, args.block, args.warmup_rounds) if args.rounds else ([], {})
    inside = host_inside(args.inside_steps, calibrate=args.calibrate)  # after the overhead run: it changes nothing there
    if args.parts:  # a second fit with the parts timed too: the first one's hook totals stay unbiased
        inside.ns.update({k: v for k, v in host_inside(args.inside_steps, parts=True).ns.items() if "." in k})
    dev = torch.cuda.get_device_name() if CUDA else "cpu"
    lines = [
        f"device {dev}  torch {torch.__version__}  lightning {pl.__version__}  {time.strftime('%Y-%m-%d')}",
        f"Lightning, launch-bound MLP: {args.rounds} rounds x {len(names)} blocks of {args.block} steps in one fit, "
        "shuffled each round; TensorBoardLogger, log_every_n_steps=50",
        *(overhead_table(names, us, width=32) if args.rounds else []),
    ]
    lines += inside.report("PhaseTimer's per-step hooks (a separate fit)", args.inside_steps)
    print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
