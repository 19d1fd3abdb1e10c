"""Every loop users write is timed right: a conformance suite of loop patterns, both doors.

Each pattern is a real loop (or a real ``Trainer``) with named places where time
can be planted.  Each row runs the pattern once per place with an hour planted there
on the host clock (``host_hours``: ``time.perf_counter_ns``, which phase-timer reads on
the CPU, jumps an hour and no real time passes), and checks that in every timed step
each phase, ``step`` and ``period`` hold exactly the planted hours expected of them:
the hour landed in the expected phase(s) and nowhere else.  The real time around it
is a few milliseconds a step, so the count of hours is exact however loaded the
machine (a real sleep and a tolerance are not: a busy 2-core runner stretches the
work after a sleep by more than any fraction of it one can allow).  The module runs
torch with one intra-op thread: the models are tiny, and a pool of threads only costs.

A new pattern is one ``Pattern`` row: a function that runs the loop with a
``plant`` to call at each place, and where each place's time must land
(``{}``: nowhere -- evaluation and validation are in no phase and not in ``period``).
The same table, in words, is ``docs/loop_patterns.md``.
"""

from __future__ import annotations

import importlib
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import phase_timer
from phase_timer.phases import BETWEEN, HOST_PHASES
from tests.helpers import CallInBackward, HostHours, hours

pytestmark = pytest.mark.timeout(300)

STEPS, WARMUP = 12, 2
#: Where a plant's time must land when it is in no phase and not in ``period`` (evaluation,
#: validation); its count says how often it fires a step.
NOWHERE = "(paused)"


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Plant:
    """An hour of the host clock where it was planted: ``plant("forward")`` fires only in the run planted there."""

    def __init__(self, where: str | None, clock: HostHours | None = None) -> None:
        self.where, self.clock = where, clock
        self.fired = 0

    def __call__(self, here: str) -> None:
        if here == self.where:
            self.fired += 1
            self.clock.jump()


class Net(nn.Module):
    """Forward sleeps at ``forward``, its backward at ``backward``; ``outputs="dict"`` returns two heads."""

    def __init__(self, plant: Plant, outputs: str = "tensor") -> None:
        super().__init__()
        self.plant, self.outputs = plant, outputs
        self.evaluating = False  # the test's evaluation forwards sleep at `eval`
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head, self.proj = nn.Linear(32, 1), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> Any:
        self.plant("eval" if self.evaluating else "forward")
        h = self.body(x)
        out = CallInBackward.apply(self.head(h), lambda: self.plant("backward"))
        return {"proj": self.proj(h), "logits": out} if self.outputs == "dict" else out


class PlantedLayer(nn.Module):
    """A layer that sleeps at ``forward`` and, in backward, at ``backward`` (for nn.Sequential models)."""

    def __init__(self, plant: Plant) -> None:
        super().__init__()
        self.plant = plant
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.plant("forward")
        return CallInBackward.apply(self.lin(x), lambda: self.plant("backward"))


def loss_of(out: torch.Tensor, y: torch.Tensor, plant: Plant) -> torch.Tensor:
    """The loss: its math sleeps at ``loss``, its own backward at ``loss_backward``."""
    plant("loss")
    return CallInBackward.apply(nn.functional.mse_loss(out, y), lambda: plant("loss_backward"))


class PlantedSGD(torch.optim.SGD):
    def __init__(self, params: Any, plant: Plant, where: str = "optimizer") -> None:
        super().__init__(params, lr=0.01)
        self.plant, self.where = plant, where

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        self.plant(self.where)
        return out


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization, the usual shape: ``first_step`` ascends, ``second_step`` steps the base."""

    def __init__(self, params: Any, base: Callable[..., torch.optim.Optimizer], plant: Plant, rho: float = 0.05) -> None:
        super().__init__(params, {"rho": rho})
        self.base_optimizer = base(self.param_groups)
        self.plant = plant

    @torch.no_grad()
    def first_step(self) -> None:
        self.plant("ascent")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = p.grad * group["rho"]
                    p.add_(e)
                    self.state[p]["e"] = e

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "e" in self.state[p]:
                    p.sub_(self.state[p]["e"])
        self.base_optimizer.step()


class Loader:
    """Batches whose fetch sleeps at ``data``."""

    def __init__(self, plant: Plant, n: int = 64, width: int = 16) -> None:
        self.plant, self.n, self.width = plant, n, width

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            self.plant("data")
            yield torch.randn(8, self.width, generator=g), torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return self.n


def attach(model: Any, opt: Any, loader: Any, tmp: Any, **kw: Any) -> phase_timer.LoopTimer:
    kw.setdefault("warmup_steps", WARMUP)
    return phase_timer.attach(model, opt, loader, log_dir=tmp, window=100, summary=False, **kw)


# -- the plain door's patterns ------------------------------------------------------------
def plain_loop(plant: Plant, tmp: Any, *, copy: bool = False, outputs: str = "tensor") -> Any:
    model = Net(plant, outputs)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp, copy_to_device=copy) as timer:
        for i, (x, y) in enumerate(timer.loader):
            plant("h2d")  # the loop's own copy
            out = model(x)
            loss = loss_of(out["logits"] if outputs == "dict" else out, y, plant)
            loss.backward()
            plant("clip")
            opt.step()
            opt.zero_grad()
            plant("between")  # a scheduler, logging
            if i + 1 == STEPS:
                break
    return timer


def plain_accumulation(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            (loss_of(model(x), y, plant) / 4).backward()
            plant("after_backward")  # non-stepping micro-batches: the device waits (idle)
            if (i + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
                plant("between")
            if i + 1 == 4 * STEPS:
                break
    return timer


def plain_grad_scaler(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    scaler = torch.amp.GradScaler("cpu")
    with attach(model, opt, Loader(plant), tmp, scaler=scaler) as timer:
        for i, (x, y) in enumerate(timer.loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            scaler.scale(loss_of(out.float(), y, plant)).backward()
            scaler.unscale_(opt)
            plant("clip")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            plant("between")
            if i + 1 == STEPS:
                break
    return timer


def plain_gan(plant: Plant, tmp: Any) -> Any:
    d, g = Net(plant), Net(Plant(None))
    opt_d, opt_g = PlantedSGD(d.parameters(), plant, "d_step"), PlantedSGD(g.parameters(), plant, "g_step")
    with attach([d, g], [opt_d, opt_g], Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            loss_of(d(x), y, plant).backward()
            opt_d.step()
            opt_d.zero_grad()
            plant("noise")  # between the two models' updates
            nn.functional.mse_loss(g(x), y).backward()
            opt_g.step()
            opt_g.zero_grad()
            plant("between")
            if i + 1 == STEPS:
                break
    return timer


def plain_sam(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    sam = SAM(model.parameters(), lambda groups: PlantedSGD(groups, plant), plant)
    with attach(model, sam, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            loss_of(model(x), y, plant).backward()
            sam.first_step()
            sam.zero_grad()
            loss_of(model(x), y, Plant(None)).backward()
            sam.second_step()
            sam.zero_grad()
            plant("between")
            if i + 1 == STEPS:
                break
    return timer


def plain_two_losses(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            out = model(x)
            nn.functional.mse_loss(out, y).backward(retain_graph=True)
            plant("second_loss")  # math between the two backward() calls
            loss_of(out, y * 2, Plant(None)).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break
    return timer


def _flaky(loss: torch.Tensor, fail: bool) -> torch.Tensor:
    """``loss``, whose backward raises when ``fail``."""

    def planted() -> None:
        if fail:
            raise RuntimeError("planted failure inside backward")

    return CallInBackward.apply(loss, planted)


def plain_skip_failed_batch(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:
        done = 0
        for i, (x, y) in enumerate(timer.loader):
            loss = _flaky(loss_of(model(x), y, plant), i in (3, 6))
            try:
                loss.backward()
            except RuntimeError:  # skip the batch (the OOM-retry pattern)
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            done += 1
            if done == STEPS:
                break
    return timer


def plain_gradient_penalty(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            xi = x.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
            plant("penalty")
            penalty = (grad.norm(dim=1) - 1).square().mean()
            (loss_of(model(x), y, plant) + penalty).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break
    return timer


def plain_grad_only(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    params = list(model.parameters())
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            grads = torch.autograd.grad(loss_of(model(x), y, plant), params, allow_unused=True)
            for p, gr in zip(params, grads):
                p.grad = gr
            opt.step()
            if i + 1 == STEPS:
                break
    return timer


def plain_checkpoint(plant: Plant, tmp: Any, *, reentrant: bool) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            x.requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
            out = checkpoint(model, x, use_reentrant=reentrant)
            loss_of(out, y, Plant(None)).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break
    return timer


def plain_checkpoint_sequential(plant: Plant, tmp: Any, *, copy: bool) -> Any:
    model = nn.Sequential(PlantedLayer(plant), nn.ReLU(), nn.Linear(16, 1))
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp, copy_to_device=copy) as timer:
        for i, (x, y) in enumerate(timer.loader):
            out = checkpoint_sequential(model, 2, x, use_reentrant=False)  # calls the children, not the model
            nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break
    return timer


def plain_evaluation(plant: Plant, tmp: Any, *, where: str) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    val_x = torch.randn(8, 16)

    def evaluate() -> None:
        model.eval()
        model.evaluating = True
        with torch.no_grad():
            model(val_x)
            model(val_x)
        model.evaluating = False
        model.train()

    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            if where == "top":
                evaluate()
            loss_of(model(x), y, plant).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break  # before an evaluation after the last step: that one has its own test (a known bug)
            if where == "after":
                evaluate()
    return timer


def plain_break_mid_epoch(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant, n=6), tmp) as timer:
        for _epoch in range(2):
            for i, (x, y) in enumerate(timer.loader):
                loss = loss_of(model(x), y, plant)
                if i == 5:
                    break  # leave the epoch half-way through a step
                loss.backward()
                opt.step()
                opt.zero_grad()
    return timer


def plain_recursive_phase(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:

        @timer.phase("walk")
        def walk(depth: int) -> None:
            plant("walk")
            if depth:
                walk(depth - 1)
                plant("walk_after")  # work after the inner call returned: still `walk`

        for i, (x, y) in enumerate(timer.loader):
            loss_of(model(x), y, plant).backward()
            walk(2)
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break
    return timer


def plain_ema(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    ema = [p.detach().clone() for p in model.parameters()]
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            loss_of(model(x), y, plant).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            plant("scheduler")
            with timer.phase("ema"), torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.99).add_(p, alpha=0.01)
                plant("ema")
            if i + 1 == STEPS:
                break
    return timer


def plain_no_loader(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, None, tmp) as timer:
        for i, (x, y) in enumerate(Loader(plant)):  # the loop's own loading: between steps
            if i == STEPS:
                break  # after a load: the last step's time between steps holds one too
            loss_of(model(x), y, plant).backward()
            opt.step()
            opt.zero_grad()
    return timer


def plain_no_loader_accumulation(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, None, tmp) as timer:
        for i, (x, y) in enumerate(Loader(plant)):  # the loop's own loading: between micro-batches, idle
            if i == 2 * STEPS:
                break  # after a load: the last step's time between steps holds one too
            (loss_of(model(x), y, plant) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
    return timer


class _PlantedItems(torch.utils.data.Dataset):
    """A map-style dataset for a real DataLoader (accelerate prepares only those)."""

    def __len__(self) -> int:
        return 64 * 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def plain_accelerate(plant: Plant, tmp: Any, *, accumulate: int = 1) -> Any:
    """A hand-written 🤗 accelerate loop: prepared model, optimizer and loader, ``accelerator.backward``,
    ``accelerator.accumulate``, ``accelerator.clip_grad_norm_`` (its optimizer wraps the real one)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # one Accelerator per run: its state is a process-wide singleton
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)

    def collate(items: list[Any]) -> Any:  # the loader's work: accelerate fetches one batch ahead
        plant("data")
        return torch.utils.data.default_collate(items)

    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    loader = torch.utils.data.DataLoader(_PlantedItems(), batch_size=8, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    with attach(model, opt, loader, tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            with accelerator.accumulate(model):
                loss = loss_of(model(x), y, plant)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    plant("clip")
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()  # steps the real optimizer only on the accumulation's last micro-batch
                opt.zero_grad()
            plant("between")
            if i + 1 == STEPS * accumulate:
                break
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return timer


def plain_no_loader_skip_failed(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, None, tmp) as timer:
        done = 0
        for i, (x, y) in enumerate(Loader(plant)):
            loss = _flaky(loss_of(model(x), y, plant), i in (3, 6))
            try:
                loss.backward()
            except RuntimeError:
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            done += 1
            if done == STEPS:
                break
    return timer


def plain_train_mode_no_grad_after_step(plant: Plant, tmp: Any, *, loader: bool) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    val_x = torch.randn(8, 16)
    source = Loader(plant)
    with attach(model, opt, source if loader else None, tmp) as timer:
        for i, (x, y) in enumerate(timer.loader if loader else source):
            loss_of(model(x), y, plant).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                break  # before an evaluation after the last step: that one has its own test (a known bug)
            with torch.no_grad():  # a no-grad forward in training mode between steps: evaluation
                model.evaluating = True
                model(val_x)
                model.evaluating = False
    return timer


def plain_phase_across_the_step_end(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp) as timer:
        for i, (x, y) in enumerate(timer.loader):
            loss_of(model(x), y, plant).backward()
            with timer.phase("stepping"):
                opt.step()  # the step ends in here
                plant("tail")  # still the user's phase, now between steps
            opt.zero_grad()
            if i + 1 == STEPS:
                break
    return timer


def plain_manual_end(plant: Plant, tmp: Any) -> Any:
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp, end_step="manual") as timer:
        for i, (x, y) in enumerate(timer.loader):
            loss_of(model(x), y, plant).backward()
            opt.step()
            plant("before_end")  # still the step: it ends at end_step()
            timer.end_step()
            plant("between")
            if i + 1 == STEPS:
                break
    return timer


# -- the Lightning door's patterns -----------------------------------------------------------
def _module_class(ns: str) -> type:
    pl = importlib.import_module(ns)

    class Planted(pl.LightningModule):
        def __init__(self, plant: Plant, manual: int = 0, scheduler: bool = False) -> None:
            super().__init__()
            self.plant = plant
            self.net = Net(plant)
            self.automatic_optimization = manual == 0
            self.n_opt = max(1, manual)
            self.scheduler = scheduler

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            if self.trainer.training:
                self.plant("before_transfer")  # batch preparation on the host, before the copy
            return batch

        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            if self.trainer.training:
                self.plant("h2d")
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if self.automatic_optimization:
                return loss_of(self.net(x), y, self.plant)
            opts = self.optimizers()
            for opt in opts if isinstance(opts, list) else [opts]:
                opt.zero_grad()
                self.manual_backward(loss_of(self.net(x), y, self.plant))
                opt.step()
            self.plant("after_steps")  # training_step goes on after its last optimizer step
            return None

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.plant("clip")

        def on_train_batch_end(self, *args: Any) -> None:
            self.plant("module_batch_end")  # an EMA in the module's own hook

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.plant("val")

        def configure_optimizers(self) -> Any:
            opts = [PlantedSGD(self.parameters(), self.plant) for _ in range(self.n_opt)]
            if self.scheduler:
                sched = SlowScheduler(opts[0], self.plant)
                return {"optimizer": opts[0], "lr_scheduler": {"scheduler": sched, "interval": "step"}}
            return opts if len(opts) > 1 else opts[0]

    return Planted


class SlowScheduler(torch.optim.lr_scheduler.StepLR):
    def __init__(self, opt: torch.optim.Optimizer, plant: Plant) -> None:
        self.plant = plant
        super().__init__(opt, step_size=1000)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.plant("scheduler")
        super().step(*args, **kwargs)


def _callback(ns: str, plant: Plant, where: str) -> Any:
    pl = importlib.import_module(ns)

    class Busy(pl.Callback):  # checkpointing, image logging, a profiler: host work at the batch end
        def on_train_batch_end(self, *args: Any) -> None:
            plant(where)

    return Busy()


def lightning_fit(plant: Plant, tmp: Any, *, ns: str = "lightning.pytorch", manual: int = 0, accumulate: int = 1,
                  val_every: int | None = None, scheduler: bool = False) -> Any:
    pl = importlib.import_module(ns)
    timer = phase_timer.PhaseTimer(warmup_steps=WARMUP, summary=False, log_every_n_steps=100)
    callbacks = [_callback(ns, plant, "callback_before"), timer, _callback(ns, plant, "callback_after")]
    steps = STEPS * (manual or 1)  # manual optimization: Lightning counts every optimizer's step
    trainer = pl.Trainer(
        default_root_dir=str(tmp), accelerator="cpu", devices=1, max_steps=steps, logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, accumulate_grad_batches=accumulate, val_check_interval=val_every,
        limit_val_batches=1 if val_every else 0, check_val_every_n_epoch=None if val_every else 1,
    )
    val = Loader(Plant(None), n=4) if val_every else None
    trainer.fit(_module_class(ns)(plant, manual=manual, scheduler=scheduler), Loader(plant, n=256), val)
    return timer


# -- the 🤗 door's patterns: a real transformers.Trainer on a tiny GPT-2 built from a config --------
def hf_trainer(plant: Plant, tmp: Any, *, accumulate: int = 1, evaluate: bool = False, checkpointing: bool = False,
               save: bool = False) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.data.data_collator import default_data_collator

    from benchmarks.models import Tokens
    from phase_timer.doors.hf_trainer import PhaseTimerCallback

    class PlantedTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            plant("loss")  # a custom compute_loss, after the model's call
            return out

        def _save(self, *args: Any, **kwargs: Any) -> Any:  # a checkpoint's save (save_strategy="steps")
            plant("save")
            return super()._save(*args, **kwargs)

    class Before(TrainerCallback):  # listed before ours
        def on_pre_optimizer_step(self, *args: Any, **kw: Any) -> None:
            plant("pre_optimizer")

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            plant("step_end")

        def on_substep_end(self, *args: Any, **kw: Any) -> None:  # a micro-batch that did not step
            plant("substep_end")

    def collate(items: list[Any]) -> Any:
        plant("data")
        return default_data_collator(items)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.register_forward_pre_hook(lambda m, a: plant("forward" if m.training else "eval"))
    model.lm_head.weight.register_hook(lambda g: plant("backward"))
    model.transformer.h[0].mlp.register_forward_pre_hook(lambda m, a: plant("block"))  # recomputed when checkpointing
    args = TrainingArguments(
        output_dir=str(tmp), per_device_train_batch_size=4, max_steps=STEPS, gradient_accumulation_steps=accumulate,
        logging_steps=5, report_to="none", save_strategy="steps" if save else "no", save_steps=3, use_cpu=True,
        disable_tqdm=True, eval_strategy="steps" if evaluate else "no", eval_steps=3, per_device_eval_batch_size=4,
        gradient_checkpointing=checkpointing,
    )
    timer = PhaseTimerCallback(warmup_steps=WARMUP, summary=False)
    trainer = PlantedTrainer(model=model, args=args, train_dataset=Tokens(256, 16, vocab=64), eval_dataset=Tokens(8, 16, vocab=64) if evaluate else None,
                             data_collator=collate, callbacks=[Before(), timer])
    trainer.train()
    return timer.timer


# -- the table ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pattern:
    name: str
    run: Callable[[Plant, Any], Any]
    #: where an hour is planted -> the phases it must land in, and how many times a step (a custom
    #: phase's time after the step's end is `between_steps.<name>`, outside `step`)
    plants: dict[str, dict[str, float]]
    #: a warning every run gives (a regex), or None for no warning from phase-timer at all
    warns: str | None = None
    #: phases that must not appear at all
    absent: tuple[str, ...] = ()
    steps: int = STEPS - WARMUP
    extra: dict[str, Any] = field(default_factory=dict)


def _p(fn: Callable[..., Any], **kw: Any) -> Callable[[Plant, Any], Any]:
    return lambda plant, tmp: fn(plant, tmp, **kw)


FWD, BWD, OPT, BETWEEN_ = {"forward": 1}, {"backward": 1}, {"optimizer": 1}, {BETWEEN: 1}
PATTERNS = [
    Pattern("plain loop", _p(plain_loop), {
        "data": {"data_wait": 1}, "h2d": {"h2d": 1}, "forward": FWD, "loss": FWD, "loss_backward": BWD,
        "backward": BWD, "clip": OPT, "optimizer": OPT, "between": BETWEEN_}),
    Pattern("plain, copy_to_device=True", _p(plain_loop, copy=True), {
        "data": {"data_wait": 1}, "h2d": FWD, "forward": FWD, "loss_backward": BWD, "between": BETWEEN_}),
    Pattern("plain, model returns a dict, the loss uses its second output", _p(plain_loop, outputs="dict"), {
        "forward": FWD, "loss": FWD, "loss_backward": BWD, "backward": BWD, "optimizer": OPT}),
    Pattern("plain, gradient accumulation x4", _p(plain_accumulation), {
        "data": {"data_wait": 4}, "forward": {"forward": 4}, "backward": {"backward": 4},
        "after_backward": {"idle": 3, "optimizer": 1}, "optimizer": OPT, "between": BETWEEN_}),
    Pattern("plain, bf16 autocast + GradScaler (scaler=)", _p(plain_grad_scaler), {
        "forward": FWD, "backward": BWD, "clip": OPT, "optimizer": OPT, "between": BETWEEN_}),
    Pattern("plain, GAN: two models, two optimizers", _p(plain_gan), {
        "forward": FWD, "backward": BWD, "d_step": OPT, "noise": FWD, "g_step": OPT, "between": BETWEEN_}),
    Pattern("plain, SAM first_step/second_step, SAM attached", _p(plain_sam), {
        "forward": {"forward": 2}, "backward": {"backward": 2}, "loss_backward": BWD, "ascent": OPT,
        "optimizer": OPT, "between": BETWEEN_}),
    Pattern("plain, two losses, two backward() calls", _p(plain_two_losses), {
        "forward": FWD, "backward": {"backward": 2}, "second_loss": FWD}),
    Pattern("plain, a batch whose backward raises is skipped", _p(plain_skip_failed_batch), {
        "forward": FWD, "backward": BWD, "loss_backward": BWD, "optimizer": OPT}, absent=("idle",)),
    Pattern("plain, gradient penalty through torch.autograd.grad", _p(plain_gradient_penalty), {
        "forward": {"forward": 2}, "penalty": FWD, "loss_backward": BWD, "optimizer": OPT}),
    Pattern("plain, gradients only from torch.autograd.grad", _p(plain_grad_only), {
        "forward": FWD, "loss_backward": FWD, "optimizer": OPT}, warns="no `backward\\(\\)` call seen",
        absent=("backward",)),
    Pattern("plain, checkpoint(model) non-reentrant", _p(plain_checkpoint, reentrant=False), {
        "forward": {"forward": 1, "backward": 1}, "backward": BWD}),
    Pattern("plain, checkpoint(model) reentrant", _p(plain_checkpoint, reentrant=True), {
        "forward": {"forward": 1, "backward": 1}, "backward": BWD}),
    Pattern("plain, checkpoint_sequential, copy_to_device=True", _p(plain_checkpoint_sequential, copy=True), {
        "forward": {"forward": 1, "backward": 1}, "backward": BWD}),
    Pattern("plain, checkpoint_sequential, the loop's own copy", _p(plain_checkpoint_sequential, copy=False), {
        "forward": {"h2d": 1, "backward": 1}, "backward": BWD}, warns="forward never ran"),
    Pattern("plain, no-grad evaluation at the top of each iteration", _p(plain_evaluation, where="top"), {
        "eval": {NOWHERE: 2}, "forward": FWD}),
    Pattern("plain, no-grad evaluation after the optimizer step", _p(plain_evaluation, where="after"), {
        "eval": {NOWHERE: 2}, "forward": FWD}),
    Pattern("plain, break out of the loader mid-step, next epoch", _p(plain_break_mid_epoch), {
        "forward": FWD, "backward": BWD, "optimizer": OPT}, absent=("idle",), steps=10 - WARMUP),
    Pattern("plain, @timer.phase re-entered (recursion)", _p(plain_recursive_phase), {
        "walk": {"walk": 3}, "walk_after": {"walk": 2}, "optimizer": OPT}),
    Pattern("plain, scheduler + EMA in timer.phase after the step", _p(plain_ema), {
        "scheduler": BETWEEN_, "ema": {"between_steps.ema": 1}, "optimizer": OPT}),
    Pattern("plain, no loader attached", _p(plain_no_loader), {
        "data": BETWEEN_, "forward": FWD, "backward": BWD, "optimizer": OPT}),
    Pattern("plain, no loader, gradient accumulation x2", _p(plain_no_loader_accumulation), {
        "data": {"idle": 1, BETWEEN: 1}, "forward": {"forward": 2}, "optimizer": OPT}),
    Pattern("plain, no loader, a batch whose backward raises is skipped", _p(plain_no_loader_skip_failed), {
        "forward": FWD, "backward": BWD, "optimizer": OPT}, absent=("idle",)),
    Pattern("plain, no-grad forward in training mode after the step", _p(plain_train_mode_no_grad_after_step,
            loader=True), {"eval": {NOWHERE: 1}, "forward": FWD}),
    Pattern("plain, no loader, no-grad forward in training mode after the step",
            _p(plain_train_mode_no_grad_after_step, loader=False), {"eval": {NOWHERE: 1}, "forward": FWD}),
    Pattern("plain, timer.phase open across the step's end", _p(plain_phase_across_the_step_end), {
        "optimizer": {"stepping": 1}, "tail": {"between_steps.stepping": 1}}),
    Pattern("plain, end_step='manual'", _p(plain_manual_end), {
        "optimizer": OPT, "before_end": OPT, "between": BETWEEN_}),
    Pattern("plain, 🤗 accelerate: prepared model, optimizer and loader", _p(plain_accelerate), {
        "data": {"data_wait": 1}, "forward": FWD, "loss": FWD, "backward": BWD, "loss_backward": BWD,
        "clip": OPT, "optimizer": OPT, "between": BETWEEN_}),
    Pattern("plain, 🤗 accelerate, accelerator.accumulate x2", _p(plain_accelerate, accumulate=2), {
        "data": {"data_wait": 2}, "forward": {"forward": 2}, "backward": {"backward": 2}, "clip": OPT,
        "optimizer": OPT, "between": {"idle": 1, BETWEEN: 1}}),
    Pattern("🤗 Trainer", _p(hf_trainer), {
        "data": {"data_wait": 1}, "forward": FWD, "loss": FWD, "backward": BWD, "pre_optimizer": OPT,
        "step_end": BETWEEN_}),
    Pattern("🤗 Trainer, gradient_accumulation_steps=2", _p(hf_trainer, accumulate=2), {
        "data": {"data_wait": 2}, "forward": {"forward": 2}, "loss": {"forward": 2}, "backward": {"backward": 2},
        "pre_optimizer": OPT, "step_end": BETWEEN_, "substep_end": {"idle": 1}}),
    Pattern("🤗 Trainer, evaluation every 3 steps", _p(hf_trainer, evaluate=True), {
        "eval": {NOWHERE: 1}, "forward": FWD}),
    Pattern("🤗 Trainer, a checkpoint every 3 steps", _p(hf_trainer, save=True), {
        "save": {NOWHERE: 1}, "forward": FWD, "step_end": BETWEEN_}),
    Pattern("🤗 Trainer, gradient_checkpointing=True", _p(hf_trainer, checkpointing=True), {
        "block": {"forward": 1, "backward": 1}, "forward": FWD, "backward": BWD}),
    Pattern("lightning, automatic optimization", _p(lightning_fit, scheduler=True), {
        "data": {"data_wait": 1}, "before_transfer": {"data_wait": 1}, "h2d": {"h2d": 1}, "forward": FWD, "loss": FWD, "backward": BWD,
        "loss_backward": BWD, "clip": OPT, "optimizer": OPT, "scheduler": BETWEEN_, "callback_before": BETWEEN_,
        "callback_after": BETWEEN_, "module_batch_end": BETWEEN_}),
    Pattern("lightning (pytorch_lightning), automatic optimization", _p(lightning_fit, ns="pytorch_lightning"), {
        "data": {"data_wait": 1}, "forward": FWD, "optimizer": OPT, "callback_before": BETWEEN_}),
    Pattern("lightning, accumulate 2, validation after every batch", _p(lightning_fit, accumulate=2, val_every=1), {
        "val": {NOWHERE: 2}, "forward": {"forward": 2}, "optimizer": OPT, "callback_before": {"idle": 1, BETWEEN: 1}}),
    Pattern("lightning, manual optimization, two optimizers", _p(lightning_fit, manual=2), {
        "forward": {"forward": 2}, "backward": {"backward": 2}, "optimizer": {"optimizer": 2},
        "after_steps": BETWEEN_, "module_batch_end": BETWEEN_}),
]


# -- running the table ---------------------------------------------------------------------------
def measure(pattern: Pattern, where: str, tmp: Any, clock: HostHours) -> tuple[dict[str, tuple[int, int]], int]:
    """One run with an hour planted at ``where``: each phase's fewest and most hours in a timed step, and the
    number of timed steps."""
    plant = Plant(where, clock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timer = pattern.run(plant, tmp)
    assert plant.fired > 0, f"{pattern.name}: nothing planted at {where!r} ran"
    ours = [str(w.message) for w in caught if "phase-timer" in str(w.message)]
    if pattern.warns is None:
        assert ours == [], ours
    else:
        assert any(re.search(pattern.warns, m) for m in ours), ours
    totals = timer.totals
    for phase in pattern.absent:
        assert phase not in totals.phases, (pattern.name, where, phase)
    return {p: (hours(t.min), hours(t.max)) for p, t in totals.phases.items()}, totals.steps


ROWS = [(p, where) for p in PATTERNS for where in p.plants]


@pytest.mark.parametrize(("pattern", "where"), ROWS, ids=[f"{p.name} | {w}" for p, w in ROWS])
def test_planted_time_lands_in_its_phase_and_nowhere_else(pattern, where, tmp_path, host_hours):
    got, steps = measure(pattern, where, tmp_path, host_hours)
    assert steps == pattern.steps
    expected = dict(pattern.plants[where])
    stated_step = expected.pop("step", None)
    expected.pop(NOWHERE, None)
    in_step = sum(k for p, k in expected.items() if p not in HOST_PHASES and p.partition(".")[0] != BETWEEN)
    expected["period"] = sum(expected.values())
    expected["step"] = in_step if stated_step is None else stated_step
    missing = {p for p, k in expected.items() if k and p not in got}
    assert not missing, f"{pattern.name}: an hour planted at {where!r}, but no {sorted(missing)} was timed"
    want = {p: (expected.get(p, 0), expected.get(p, 0)) for p in got}
    assert got == want, (
        f"{pattern.name}: an hour planted at {where!r} -> (fewest, most) hours a step per phase {got}, expected {want}"
    )


# -- the pieces the table cannot show --------------------------------------------------------------
def test_a_phase_entered_on_two_threads_at_once_times_the_loop_thread_only(tmp_path, host_hours):
    """Both threads inside ``walk`` at once; the loop thread leaves it first, an hour on, then the other
    thread, another hour on: ``walk`` holds the loop thread's hour, not the other's (it waits in ``optimizer``)."""
    plant = Plant(None)
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    inside = threading.Barrier(2)
    loop_left = threading.Event()
    with attach(model, opt, Loader(plant), tmp_path) as timer:
        phase = timer.phase("walk")

        def other_thread() -> None:
            with phase:
                inside.wait()  # both threads inside the phase at once
                loop_left.wait()
                host_hours.jump()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, (x, y) in enumerate(timer.loader):
                loss_of(model(x), y, plant).backward()
                loop_left.clear()
                t = threading.Thread(target=other_thread)
                t.start()
                with phase:
                    inside.wait()
                    host_hours.jump()
                loop_left.set()
                t.join()  # the other thread's time is not the loop's (it waits here, in `optimizer`)
                opt.step()
                if i + 1 == STEPS:
                    break
    phases = timer.totals.phases
    assert (hours(phases["walk"].min), hours(phases["walk"].max)) == (1, 1)
    assert (hours(phases["optimizer"].min), hours(phases["optimizer"].max)) == (1, 1)
    assert any("another thread" in str(w.message) or "other than the training loop" in str(w.message) for w in caught)


@pytest.mark.parametrize("train_mode", [False, True], ids=["eval mode", "train mode, no grad"])
def test_an_evaluation_after_the_last_step_is_not_in_its_period(tmp_path, host_hours, train_mode):
    """The rows above evaluate between steps; here the loop's last act is an evaluation, as when a run
    ends with a final validation.  It is in no phase, and in no step's period either."""
    plant = Plant("eval", host_hours)
    model = Net(plant)
    opt = PlantedSGD(model.parameters(), plant)
    with attach(model, opt, Loader(plant), tmp_path) as timer:
        for i, (x, y) in enumerate(timer.loader):
            loss_of(model(x), y, plant).backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == STEPS:
                model.train(train_mode)
                model.evaluating = True
                with torch.no_grad():
                    model(x)
                break
    phases = timer.totals.phases
    assert plant.fired == 1 and timer.totals.steps == STEPS - WARMUP
    assert {p: hours(t.max) for p, t in phases.items()} == dict.fromkeys(phases, 0)


def test_the_backward_wrapper_is_one_however_many_timers_and_goes_away(tmp_path):
    original = torch.autograd.backward
    a = attach(Net(Plant(None)), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), None, tmp_path / "a")
    wrapped = torch.autograd.backward
    b = attach(Net(Plant(None)), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), None, tmp_path / "b")
    assert wrapped is not original and torch.autograd.backward is wrapped
    a.close()
    assert torch.autograd.backward is wrapped  # b still listens
    b.close()
    assert torch.autograd.backward is original
