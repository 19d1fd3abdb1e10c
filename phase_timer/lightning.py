"""``PhaseTimer``: the Lightning callback.  It only turns hooks into calls on the core.

Where the boundaries sit (see the README for what each phase means):

=================  ===============================================================
mark               Lightning event
=================  ===============================================================
``h2d`` starts     entry of ``trainer.strategy.batch_to_device`` (wrapped on the instance)
``forward``        exit of that wrapper
``backward``       ``on_before_backward``
``optimizer``      ``on_after_backward`` (manual optimization: the torch optimizers' own
                   step pre-hooks; after the step, ``forward`` again)
step end           ``on_train_batch_end`` of a batch that stepped the optimizer
=================  ===============================================================
"""

from __future__ import annotations

import importlib
import os
import time
from typing import TYPE_CHECKING, Any

from phase_timer.clock import make_clock
from phase_timer.config import TimerConfig, disabled_by_env
from phase_timer.core import TimingCore
from phase_timer.metrics import custom_scalars_layout
from phase_timer.optim_hooks import StepHooks
from phase_timer.ranks import RankExchange
from phase_timer.sinks import BackgroundSink, GuardedSink, Sink, SummaryWriterSink, next_version_dir, open_event_file

if TYPE_CHECKING:
    import lightning.pytorch as pl

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _import_namespaces() -> list[Any]:
    found = []
    for name in _NAMESPACES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "phase_timer.PhaseTimer needs PyTorch Lightning (`lightning` or `pytorch-lightning`), which is not "
            "installed: pip install 'phase-timer[lightning]'"
        )
    return found


_PL = _import_namespaces()
# Subclassing the Callback of every installed namespace makes one class that any
# Trainer accepts (before 2.6.0 a Trainer refused a Callback of the other namespace).
_CALLBACK_BASES = tuple(dict.fromkeys(m.Callback for m in _PL))
_TENSORBOARD_LOGGERS = tuple(
    cls for m in _PL if (cls := getattr(importlib.import_module(f"{m.__name__}.loggers"), "TensorBoardLogger", None))
)


class _LoggerSink:
    """Any Lightning logger: ``log_metrics`` at the step the values belong to."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._logger.log_metrics(scalars, step=step)

    def flush(self) -> None:
        self._logger.save()

    def close(self) -> None:
        self._logger.save()


class PhaseTimer(*_CALLBACK_BASES):  # type: ignore[misc]
    """Times every training step's phases on the device's own clock, lazily, and logs them.

    Args (keyword-only):
        log_every_n_steps: steps per logging window; ``None`` uses the Trainer's.
        warmup_steps: optimizer steps at the start of each ``fit`` that are not timed.
        max_pending: steps that may wait for the device before new ones go untimed.
        per_step: also write every step's values (``phase_time_step/*``), ~7 scalars a step.
        summary: print the table at the end of ``fit`` (rank zero).
        log_dir: where to write TensorBoard files when the Trainer has no logger
            (default ``<default_root_dir>/phase_timer/version_N``).
        nvtx: also push each phase as an NVTX range (Nsight Systems); off by default.
        trace_steps: ``(first, stop)``: write a Chrome/Perfetto trace of these steps'
            phases on the device's timeline (``trace_path``, default
            ``<log_dir>/phase_trace.json``), at the end of ``fit``.
        rank_timeout_s: distributed runs: how long rank zero waits, at the end of ``fit``,
            for the other ranks' last reports (after an exception: no wait at all).
        enabled: ``False`` makes it a no-op; so does ``PHASE_TIMER_DISABLE=1``.  Under
            torch.distributed it must be the same on every rank (setting up creates a
            process group, a collective); only rank zero writes anyway.
    """

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
        enabled: bool = True,
    ) -> None:
        super().__init__()
        self.config = TimerConfig(
            window=log_every_n_steps,
            warmup_steps=warmup_steps,
            max_pending=max_pending,
            per_step=per_step,
            summary=summary,
            log_dir=log_dir,
            nvtx=nvtx,
            trace_steps=trace_steps,
            trace_path=trace_path,
            rank_timeout_s=rank_timeout_s,
            owner="PhaseTimer",
            window_arg="log_every_n_steps",
        )
        if not isinstance(enabled, bool):
            raise ValueError(f"PhaseTimer(enabled={enabled!r}): `enabled` must be True or False, got {enabled!r}")
        self.enabled = enabled and not disabled_by_env()
        self.core: TimingCore | None = None
        self.last_summary: str | None = None
        self.log_dir: str | None = None
        self._trainer: pl.Trainer | None = None
        self._originals: list[tuple[Any, str, Any, bool]] = []
        self._sync_wait_ns = 0
        self._hooks: list[Any] = []
        self._last_batch_end = 0
        self._paused_at = 0
        self._global_step_at_batch = 0
        self.totals = None

    # -- install / uninstall ------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        self._trainer = trainer
        self._sync_wait_ns = 0
        original = trainer.strategy.batch_to_device

        def batch_to_device(batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
            if self.core is None or not trainer.training:
                return original(batch, device, dataloader_idx)
            self._before_transfer(trainer)
            out = original(batch, device, dataloader_idx)
            self.core.phase("forward")
            return out

        self._patch(trainer.strategy, "batch_to_device", batch_to_device)
        # Lightning 2.6 broadcasts a SIGTERM flag before every batch when distributed and
        # reads it back with `.item()`: the host waits there for the device and the other
        # ranks.  That wait is timed as `sync_wait`, so that it is not counted as data_wait.
        epoch_loop = trainer.fit_loop.epoch_loop
        broadcast = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
        if callable(broadcast):

            def timed_broadcast(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter_ns()
                try:
                    return broadcast(*args, **kwargs)
                finally:
                    self._sync_wait_ns += time.perf_counter_ns() - t0

            self._patch(epoch_loop, "_broadcast_sigterm_tensor", timed_broadcast)

    def _patch(self, obj: Any, name: str, replacement: Any) -> None:
        """Replace ``obj.name`` on the instance; :meth:`_restore` puts back what was there."""
        self._originals.append((obj, name, obj.__dict__.get(name), name in obj.__dict__))
        setattr(obj, name, replacement)

    def _restore(self) -> None:
        for obj, name, previous, had_attr in reversed(self._originals):
            if had_attr:
                setattr(obj, name, previous)
            else:
                obj.__dict__.pop(name, None)
        self._originals = []
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or not self._originals:
            return
        cfg = self.config
        clock = make_clock(trainer.strategy.root_device)
        ranks = RankExchange.create()  # None unless distributed; a collective: every rank is here
        sinks = self._make_sinks(trainer, ranks is not None) if trainer.is_global_zero else []
        self.core = TimingCore(
            clock,
            sinks,
            window=cfg.window or max(1, trainer.log_every_n_steps or 50),
            warmup_steps=cfg.warmup_steps,
            max_pending=cfg.max_pending,
            per_step=cfg.per_step,
            nvtx=cfg.nvtx,
            trace=cfg.make_trace(self.log_dir or trainer.default_root_dir, clock.kind) if trainer.is_global_zero else None,
            ranks=ranks,
        )
        if not pl_module.automatic_optimization:  # trainer.optimizers: the torch optimizers themselves
            self._hooks.append(StepHooks(trainer.optimizers, self._manual_step_start, self._manual_step_end))

    def _make_sinks(self, trainer: pl.Trainer, ranks: bool) -> list[Sink]:
        sinks: list[Sink] = []
        for lg in trainer.loggers:
            if isinstance(lg, _TENSORBOARD_LOGGERS):
                layout = custom_scalars_layout(self.config.per_step, ranks)
                writer = SummaryWriterSink(lg.experiment, owned=False, layout=layout)
                sink: Sink = BackgroundSink(writer, type(lg).__name__)
                self.log_dir = lg.log_dir
            else:
                sink = GuardedSink(_LoggerSink(lg), type(lg).__name__)
            sinks.append(sink)
        if not sinks:
            self.log_dir = self._own_log_dir(trainer)
            sinks.append(open_event_file(self.log_dir, per_step=self.config.per_step, ranks=ranks))
        return sinks

    def _own_log_dir(self, trainer: pl.Trainer) -> str:
        if self.config.log_dir is not None:
            return os.fspath(self.config.log_dir)
        return next_version_dir(os.path.join(trainer.default_root_dir, "phase_timer"))

    # -- the step -----------------------------------------------------------------
    def _before_transfer(self, trainer: pl.Trainer) -> None:
        core = self.core
        assert core is not None
        sync_ns, self._sync_wait_ns = self._sync_wait_ns, 0
        wait_ms = max(0.0, (time.perf_counter_ns() - self._last_batch_end - sync_ns) / 1e6)
        if core.in_step:  # next micro-batch of an accumulated step
            core.phase("h2d")
        else:
            epoch_loop = trainer.fit_loop.epoch_loop
            # The step Lightning logs this batch's metrics at.
            core.begin_step(getattr(epoch_loop, "_batches_that_stepped", trainer.global_step), "h2d")
        core.add_host("data_wait", wait_ms)
        if sync_ns:
            core.add_host("sync_wait", sync_ns / 1e6)
        self._global_step_at_batch = trainer.global_step

    def _manual_step_start(self, opt: Any) -> None:
        if self.core is not None:
            self.core.phase("optimizer")

    def _manual_step_end(self, opt: Any) -> None:
        if self.core is not None:
            self.core.phase("forward")  # back in the user's training_step

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self.core is not None:
            self.core.phase("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.core is not None:
            # Automatic optimization: all that follows backward is the optimizer's
            # (clipping, scaler, step).  Manual: back to the user's training_step.
            self.core.phase("optimizer" if pl_module.automatic_optimization else "forward")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        core = self.core
        if core is None or not core.in_step:
            return
        if trainer.global_step != self._global_step_at_batch:
            core.end_step()
        else:  # accumulating: what follows until the next micro-batch is the device waiting
            core.relabel("idle")
        self._last_batch_end = time.perf_counter_ns()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync_wait_ns = 0  # a broadcast before the last epoch's end belongs to no batch
        if self.core is not None:
            self.core.resume()
        self._last_batch_end = time.perf_counter_ns()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.core is not None:
            self.core.end_step()  # an accumulation cut short by the epoch's end
            self.core.pause()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.core is not None:
            self.core.pause()
            self._paused_at = time.perf_counter_ns()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.core is not None and not trainer.sanity_checking:
            self.core.resume()
            # Validation is nobody's data_wait: move the reference past it.
            self._last_batch_end += time.perf_counter_ns() - self._paused_at

    # -- the end --------------------------------------------------------------------
    def _finish(self, trainer: pl.Trainer, *, interrupted: bool) -> None:
        self._restore()
        core, self.core = self.core, None
        if core is None:
            return
        # The one blocking wait: pending steps are resolved and written (and the other
        # ranks' last reports awaited, briefly when the run failed: a rank may be gone).
        core.finish(rank_timeout_s=self.config.rank_timeout_s, interrupted=interrupted)
        if self.config.summary or interrupted:
            self.last_summary = core.summary_table("phase-timer" + (" (interrupted)" if interrupted else ""))
            if trainer.is_global_zero and self.config.summary:
                print(self.last_summary, flush=True)
        self.totals = core.totals

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish(trainer, interrupted=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(trainer, interrupted=True)
