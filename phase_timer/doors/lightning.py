"""``PhaseTimer``: the Lightning callback.  It only reports Lightning's events as boundaries.

What each phase means is defined once, in :mod:`phase_timer.run.boundaries`; here is
where Lightning tells us each boundary happened:

==================  ================================================================
boundary            Lightning event
==================  ================================================================
fetch               the training epoch loop's fetch of the next batch (the hooks it
                    calls around ``next(data_fetcher)``); ``data_wait`` is the time inside,
                    and Lightning's own hooks after it up to the transfer
                    (``on_before_batch_transfer``: batch preparation on the host)
batch (``h2d``)     entry of ``trainer.strategy.batch_to_device`` (wrapped on the instance)
copied (forward)    exit of that wrapper
                    (``training_step(self, dataloader_iter)``: the step begins with
                    ``forward`` at ``on_train_batch_start``; its fetches inside the step
                    are ``data_wait`` on the host, and ``forward`` on the device)
backward            ``on_before_backward`` .. ``on_after_backward``
optimizer           after backward (automatic); manual: the torch optimizers' step pre-hooks
step end            the torch optimizers' step post-hooks, and the precision plugin's
                    ``GradScaler.update()`` (a skipped inf/nan step ends there)
pause               validation (``on_validation_start`` .. ``on_validation_end``), epoch ends
==================  ================================================================
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phase_timer.doors import backward_calls
from phase_timer.measures import oom
from phase_timer.doors.assemble import start_core
from phase_timer.run.boundaries import Boundaries, ending_at
from phase_timer.measures.comm import attach_comm
from phase_timer.config import disabled_by_env, reject_unknown
from phase_timer.run.core import TimingCore
from phase_timer.doors.door import Door, documented
from phase_timer.doors.lightning_trainer import (let_go_of_module, remade, steps_count, timer_class, train_loader_info,
                                                 trainer_outputs, wrap_internals)
from phase_timer.doors.optim_hooks import StepHooks, optimizer_info
from phase_timer.doors.options import Options
from phase_timer.patches import Patches
from phase_timer.timing.stats import RunTotals

if TYPE_CHECKING:
    import lightning.pytorch as pl


@documented(run="each ``fit``", end="the end of ``fit``")
class PhaseTimer(Door):
    """Times every training step's phases on the device's own clock, lazily, and logs them.

    An instance is a ``Callback`` of the Lightning namespace in use (``lightning.pytorch`` or
    ``pytorch_lightning``, whichever the program imported; both if it imported both), so any
    Trainer accepts it; importing ``phase_timer`` imports neither.

    Files: values go to the Trainer's loggers. Without a logger (``logger=False``) nothing is
    written unless ``log_dir`` is given (the table and ``timer.totals`` still say it all); under
    ``fast_dev_run`` nothing is written unless ``log_dir`` is given.

    Args (keyword-only):
        log_every_n_steps: steps per logging window; ``None`` uses the Trainer's.
        log_dir: where to write TensorBoard files and the summary file of a Trainer with no logger
            (default: nowhere), or under ``fast_dev_run``.
        {options}

    Attributes (the last ``fit``'s, readable in code after it; ``None`` before):
        {results}
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> PhaseTimer:
        return super().__new__(timer_class(cls))

    def __reduce__(self) -> tuple[Any, ...]:
        # The class an instance is made of exists only in this process: pickle the one it was made for.
        return remade, (getattr(type(self), "_timer_base", type(self)), dict(self.__dict__))

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        warmup_steps: int = 5,
        max_pending: int = 64,
        per_step: bool = False,
        summary: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        nvtx: bool = False,
        trace_steps: tuple[int, int] | None = None,
        trace_path: str | os.PathLike[str] | None = None,
        rank_timeout_s: float = 30.0,
        memory: bool = True,
        samples_per_batch: int | Callable[[Any], int] | None = None,
        tokens_per_batch: int | Callable[[Any], int] | None = None,
        flops_per_step: float | dict[str, float] | None = None,
        peak_tflops: float | None = None,
        mfu: bool = True,
        enabled: bool = True,
        memory_snapshot: bool | str | os.PathLike[str] | None = None,
        modules: bool | int | Sequence[str] = False,
        **unknown: Any,
    ) -> None:
        reject_unknown("PhaseTimer", PhaseTimer.__init__, unknown)
        super().__init__()
        self.config = Options.of("PhaseTimer", locals(), window="log_every_n_steps")
        self.enabled = enabled and not disabled_by_env()
        if not self.enabled:
            self.totals = RunTotals()  # a disabled timer's results exist, and are empty
        self.core: TimingCore | None = None
        self._bounds: Boundaries | None = None
        self._patches = Patches()
        self._hooks: list[Any] = []
        self._sync_wait_ns = 0
        self._fetch_ns = 0  # host time inside Lightning's fetch since the last batch
        self._fetch_t0 = 0
        self._fetch_end = 0  # when the last fetch returned (0: none since the last batch)
        self._iter_mode = False  # training_step(self, dataloader_iter): the step fetches its own batch
        self._fetch_hooked = False
        self._global_step_at_batch = 0
        self._steps_total: Any = None  # Lightning's own count of optimizer steps (None: read global_step)
        self._trainer_ref: Any = None  # the fit's Trainer, weakly, while it runs (to write it if never ended)
        self._raw_backward: backward_calls.RawBackward | None = None

    # -- install / uninstall ------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        self._sync_wait_ns = self._fetch_ns = self._fetch_end = 0
        wrap_internals(self, trainer)

    def _patch(self, obj: Any, name: str, replacement: Any) -> None:
        """Replace ``obj.name`` on the instance; :meth:`_restore` puts back what was there."""
        self._patches.replace(obj, name, replacement)

    def _restore(self) -> None:
        self._patches.put_back()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._raw_backward is not None:
            backward_calls.unlisten(self._raw_backward)
            self._raw_backward = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or not self._patches:
            return
        cfg = self.config
        # Files only where the user asked for them: the Trainer's loggers, or log_dir (a debug run
        # with fast_dev_run, like Lightning itself, leaves nothing behind unless log_dir says where).
        writes = trainer.is_global_zero and (cfg.log_dir is not None or not getattr(trainer, "fast_dev_run", False))
        root = trainer.strategy.root_device
        self.core = start_core(
            cfg, root, door="lightning", window=cfg.window or max(1, trainer.log_every_n_steps or 50),
            outputs=trainer_outputs(trainer, cfg) if writes else None, trace_dir=trainer.default_root_dir,
            context=dict(precision=str(trainer.precision), optimizers=optimizer_info(trainer.optimizers)),
            models=[pl_module],
        )
        self.log_dir = self.core.log_dir  # this fit's
        bounds = self._bounds = Boundaries(
            self.core, no_end_hint="no torch optimizer step ended (an optimizer_step that never calls the optimizer?)"
        )
        self._trainer_ref = weakref.ref(trainer)
        # DDP's and FSDP2's waits for their collectives, split out (phase_timer/comm): DDPStrategy's module (its
        # ddp_comm_hook inside), a module sharded with fully_shard (ModelParallelStrategy's configure_model).
        self._comm = attach_comm([trainer.strategy.model], self.core)
        self._opened(self.core)
        self._iter_mode = type(getattr(trainer.fit_loop, "_data_fetcher", None)).__name__ == "_DataLoaderIterDataFetcher"
        if self._iter_mode:  # the fetch runs inside the step: its wait is all taken as reaching the device
            self.core.context["fetch_in_step"] = True
        # trainer.optimizers are the torch optimizers themselves.  Their post-hook ends the
        # step.  Automatic optimization calls `optimizer.step(closure)` before it runs
        # training_step, so only manual optimization takes the pre-hook as `optimizer`.
        manual = not pl_module.automatic_optimization
        self._steps_total = steps_count(trainer, manual)
        if manual:  # a raw `loss.backward()` fires no Lightning hook: heard at torch.autograd.backward
            self._raw_backward = backward_calls.RawBackward(self, threading.get_ident())
            backward_calls.listen(self._raw_backward)
        self._hooks.append(
            StepHooks(trainer.optimizers, bounds.on_optimizer_start if manual else None, lambda opt: bounds.on_step_end(),
                      bounds.before_backward)
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and callable(getattr(scaler, "update", None)):
            self._patch(scaler, "update", ending_at(scaler.update, lambda: self._bounds))

    # -- the step -----------------------------------------------------------------
    def _on_batch(self, trainer: pl.Trainer, bounds: Boundaries) -> None:
        sync_ns, self._sync_wait_ns = self._sync_wait_ns, 0
        fetch_ns, self._fetch_ns = self._fetch_ns, 0
        if self._fetch_end:  # Lightning's hooks between its fetch and the transfer prepare the batch
            fetch_ns += time.perf_counter_ns() - self._fetch_end
            self._fetch_end = 0
        # _optimizer_steps and _log_step, written out: each batch, two frames fewer (~1 µs in a real step)
        total = self._steps_total
        self._global_step_at_batch = steps = total.completed if total is not None else trainer.global_step
        logged = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
        bounds.on_batch(steps if logged is None else logged, fetch_ns / 1e6 if self._fetch_hooked else None,
                        sync_ns / 1e6)

    def _optimizer_steps(self, trainer: pl.Trainer) -> int:
        """``trainer.global_step``, read as one attribute where it can be (``steps_count``)."""
        total = self._steps_total
        return total.completed if total is not None else trainer.global_step

    @staticmethod
    def _log_step(trainer: pl.Trainer, global_step: int) -> int:
        """The step Lightning logs this batch's metrics at."""
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
        return global_step if step is None else step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        bounds = self._bounds
        if bounds is None or not self._iter_mode:
            return
        # training_step(self, dataloader_iter): no batch_to_device; the step fetches and copies
        # its own batch, so it begins here, with forward.
        bounds.fetch()
        sync_ns, self._sync_wait_ns = self._sync_wait_ns, 0
        self._global_step_at_batch = steps = self._optimizer_steps(trainer)
        bounds.batch(self._log_step(trainer, steps), None, sync_ns / 1e6, first="forward")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._bounds is not None:
            self._bounds.on_backward_start()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bounds is not None:
            self._bounds.on_backward_end(False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        bounds = self._bounds
        if bounds is None or not bounds.open or bounds.ended:
            return
        if self._optimizer_steps(trainer) != self._global_step_at_batch:
            # The optimizer stepped where no torch step hook saw it (a custom `optimizer_step`):
            # the step ends here, late, rather than merging into the next batch.
            bounds.step_end()
        else:
            bounds.micro_batch_end()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A broadcast or a fetch (the one that found the loader empty) before the last epoch's
        # end belongs to no batch.
        self._sync_wait_ns = self._fetch_ns = self._fetch_end = 0

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bounds is not None:
            self._bounds.epoch_end()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bounds is not None:
            self._bounds.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bounds is not None:
            self._bounds.resume()

    # -- the end --------------------------------------------------------------------
    def _finish(self, trainer: pl.Trainer | None, *, interrupted: bool, wait: bool = True) -> None:
        self._closing()
        self._restore()
        self._drop_comm(self.core)
        core, self.core = self.core, None
        bounds, self._bounds = self._bounds, None
        self._steps_total = self._trainer_ref = None  # the fit's own: nothing of it kept (or pickled) past its end
        let_go_of_module(self)
        if core is None or bounds is None:
            return
        bounds.finish(interrupted=interrupted)
        if trainer is not None:
            core.context["loader"] = train_loader_info(trainer)
        # The table is made where it is printed, or where the fit was interrupted (then ``last_summary`` says so).
        self._ended(core, interrupted=interrupted, wait=wait, table=self.config.summary or interrupted)

    def _close_unclosed(self, interrupted: bool, why: str) -> None:
        """The fit never reached teardown (the process is exiting, or SIGTERM): write what it measured."""
        ref = self._trainer_ref
        self._finish(ref() if ref is not None else None, interrupted=True, wait=why != "on SIGTERM")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish(trainer, interrupted=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # An out-of-memory error is explained before the run is closed: the boundaries are where it happened.
        oom.caught(exception, self.core, self._bounds, optimizers=getattr(trainer, "optimizers", ()))
        self._finish(trainer, interrupted=True)


