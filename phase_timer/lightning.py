"""``PhaseTimer``: the Lightning callback.  It only reports Lightning's events as boundaries.

What each phase means is defined once, in :mod:`phase_timer.boundaries`; here is
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

import importlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phase_timer import backward_calls, lifecycle, oom
from phase_timer.assemble import Outputs, own_event_file, start_core
from phase_timer.boundaries import Boundaries, ending_at
from phase_timer.config import TimerConfig, disabled_by_env, reject_unknown
from phase_timer.comm import attach_comm
from phase_timer.core import TimingCore
from phase_timer.tags import custom_scalars_layout
from phase_timer.optim_hooks import StepHooks
from phase_timer.patches import Patches
from phase_timer.runinfo import loader_info, optimizer_info
from phase_timer.sinks import BackgroundSink, GuardedSink, SummaryWriterSink
from phase_timer.stats import RunTotals
from phase_timer.syncs import SyncSite

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _namespaces_in_use() -> list[Any]:
    """The Lightning namespaces the user has imported; if none yet, the one installed (``lightning`` first).

    Never both unasked: importing one of them rebinds the rank-zero logger the two share, so
    ``lightning.pytorch``'s messages would go out under ``pytorch_lightning``'s logger name.
    """
    found = [sys.modules[name] for name in _NAMESPACES if name in sys.modules]
    if found:
        return found
    for name in _NAMESPACES:
        try:
            return [importlib.import_module(name)]
        except ImportError:
            continue
    raise ImportError(
        "phase_timer.PhaseTimer needs PyTorch Lightning (`lightning` or `pytorch-lightning`), which is not "
        "installed: pip install 'phase-timer[lightning]'"
    )


#: The class an instance is made of, per (PhaseTimer or a user's subclass, Callback bases).
_CLASSES: dict[tuple[type, ...], type] = {}


def _timer_class(cls: type) -> type:
    """``cls`` (PhaseTimer, or a user's subclass) with the Callback of every Lightning namespace in use as
    bases too; ``cls`` itself when it already has them."""
    bases = tuple(dict.fromkeys(m.Callback for m in _namespaces_in_use()))
    if all(issubclass(cls, b) for b in bases):
        return cls
    made = _CLASSES.get((cls, *bases))
    if made is None:
        made = type(cls.__name__, (cls, *bases), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                                   "_timer_base": cls})
        _CLASSES[(cls, *bases)] = made
    return made


def _remade(cls: type, state: dict[str, Any]) -> Any:
    """Unpickling: the instance again, of the class made for ``cls`` in this process."""
    obj = object.__new__(_timer_class(cls))
    obj.__dict__.update(state)
    return obj


def _tensorboard_loggers(trainer: Any) -> tuple[type, ...]:
    """TensorBoardLogger of the trainer's own namespace (the one it was built from)."""
    ns = type(trainer).__module__.split(".trainer")[0]
    try:
        cls = getattr(importlib.import_module(f"{ns}.loggers"), "TensorBoardLogger", None)
    except ImportError:
        return ()
    return (cls,) if cls is not None else ()


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


class _RawBackward:
    """Manual optimization: a ``loss.backward()`` the step calls itself, not ``self.manual_backward``.

    Lightning's ``on_before_backward``/``on_after_backward`` bracket only ``manual_backward``; a raw call
    goes through ``torch.autograd.backward`` alone (:mod:`phase_timer.backward_calls`).  Taken only where
    Lightning's hooks have not begun the backward already, on the training loop's thread.
    """

    def __init__(self, timer: PhaseTimer, thread: int) -> None:
        self._timer, self._thread = timer, thread

    def _backward_began(self) -> bool:
        bounds = self._timer._bounds
        if bounds is None or bounds.in_backward or threading.get_ident() != self._thread:
            return False  # manual_backward: Lightning's own hooks have it
        bounds.on_backward_start()
        return bounds.in_backward

    def _backward_ended(self, failed: bool) -> None:
        bounds = self._timer._bounds
        if bounds is not None:
            bounds.on_backward_end(failed)


class PhaseTimer:
    """Times every training step's phases on the device's own clock, lazily, and logs them.

    An instance is a ``Callback`` of the Lightning namespace in use (``lightning.pytorch`` or
    ``pytorch_lightning``, whichever the program imported; both if it imported both), so any
    Trainer accepts it; importing ``phase_timer`` imports neither.

    Files: values go to the Trainer's loggers. Without a logger (``logger=False``) nothing is
    written unless ``log_dir`` is given (the table and ``timer.totals`` still say it all); under
    ``fast_dev_run`` nothing is written unless ``log_dir`` is given.

    Args (keyword-only):
        log_every_n_steps: steps per logging window; ``None`` uses the Trainer's.
        warmup_steps: optimizer steps at the start of each ``fit`` that are not timed.
        max_pending: steps that may wait for the device before new ones go untimed.
        per_step: also write every step's values (``phase_time_step/*``), ~7 scalars a step.
        summary: print the table at the end of ``fit`` (rank zero).
        log_dir: where to write TensorBoard files and the summary file of a Trainer with no logger
            (default: nowhere), or under ``fast_dev_run``.
        nvtx: also push each phase as an NVTX range (Nsight Systems); off by default.
        trace_steps: ``(first, stop)``: write a Chrome/Perfetto trace of these steps'
            phases on the device's timeline (``trace_path``, default
            ``<log_dir>/phase_trace.json``), at the end of ``fit``.
        rank_timeout_s: distributed runs: how long rank zero waits, at the end of ``fit``,
            for the other ranks' last reports (after an exception: no wait at all).
        memory: on CUDA, read the caching allocator's counters at each boundary of a sampled step
            (about one in 128; never a sync, never a reset of the user's peak): memory per phase,
            the peak's phase, creep and headroom (``phase_memory/*``).  ``False``: not read.
        samples_per_batch, tokens_per_batch: throughput's counts of a batch (``throughput/*``: samples,
            tokens and steps a second, from ``period``).  ``None`` (default) reads them from the batch's
            shapes on the host: a tensor's leading dimension; tokens, the input ids' ``numel`` (an integer
            tensor of 2+ dimensions, or a mapping's ``input_ids``), padding included.  Or a count, or a
            function of the batch (e.g. the tokens that are not padding, counted on the host).
        flops_per_step, peak_tflops, mfu: FLOPs and MFU (``throughput/tflops_per_s``, ``throughput/mfu*``, the
            table's MFU line).  The FLOPs of a step are counted once per batch shape with ``FlopCounterMode`` on
            an untimed warm-up step (a new shape later: on its first step, left untimed), or given:
            ``flops_per_step=`` FLOPs per optimizer step, or ``{"forward": f, "backward": b}``.  The peak is
            the table's dense tensor-core peak for the device and the precision the matmuls ran in, or
            ``peak_tflops=`` (TFLOP/s; needed for a device the table lacks, and on the CPU).  ``mfu=False``
            counts nothing.  What is counted, and MFU's definition: ``docs/flops.md``.
        enabled: ``False`` makes it a no-op; so does ``PHASE_TIMER_DISABLE=1``.  Under
            torch.distributed it must be the same on every rank (rank zero expects every
            rank's reports); only rank zero writes anyway.
        memory_snapshot: CUDA: record the caching allocator's history (Python stacks, the last
            100,000 allocations and frees) from the start of ``fit`` and dump a snapshot for
            https://pytorch.org/memory_viz on an out-of-memory error: ``True`` writes
            ``memory_snapshot.pickle`` beside the summary file, ``"end"`` also at the end of ``fit``,
            a path writes there.  Off by default: every allocation and free pays for its stack
            (``docs/faults.md``).  On a CPU it warns once and records nothing.

    Attributes (readable in code after ``fit``; ``None`` before):
        totals: a :class:`phase_timer.stats.RunTotals` of every timed step of the last ``fit``.
        last_summary: the summary table as printed (rank zero).
        diagnosis: the verdict, a :class:`phase_timer.Diagnosis` (rank zero).
        summary_path: where rank zero wrote ``phase_timer_summary.json`` (None: not written).
        log_dir: the directory the TensorBoard values went to (the logger's, or our own).
        syncs: the host-device syncs of one warm-up step, each a :class:`phase_timer.syncs.SyncSite`
            (phase, where, code, count, known cause); ``sync_census`` says whether the census ran, or why not.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> PhaseTimer:
        return super().__new__(_timer_class(cls))

    def __reduce__(self) -> tuple[Any, ...]:
        # The class an instance is made of exists only in this process: pickle the one it was made for.
        return _remade, (getattr(type(self), "_timer_base", type(self)), dict(self.__dict__))

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
        **unknown: Any,
    ) -> None:
        reject_unknown("PhaseTimer", PhaseTimer.__init__, unknown)
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
            memory=memory,
            samples_per_batch=samples_per_batch,
            tokens_per_batch=tokens_per_batch,
            flops_per_step=flops_per_step,
            peak_tflops=peak_tflops,
            mfu=mfu,
            memory_snapshot=memory_snapshot,
            owner="PhaseTimer",
            window_arg="log_every_n_steps",
        )
        if not isinstance(enabled, bool):
            raise ValueError(f"PhaseTimer(enabled={enabled!r}): `enabled` must be True or False, got {enabled!r}")
        self.enabled = enabled and not disabled_by_env()
        self.core: TimingCore | None = None
        self._comm: list[Any] = []
        self.last_summary: str | None = None
        self.log_dir: str | None = None
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
        self._open_key: int | None = None
        self._raw_backward: _RawBackward | None = None
        #: A disabled timer's results exist, and are empty.
        self.totals: RunTotals | None = None if self.enabled else RunTotals()
        #: The verdict (:class:`phase_timer.Diagnosis`), set at the end of ``fit``.
        self.diagnosis = None
        #: Where rank zero wrote ``phase_timer_summary.json`` (None: not written).
        self.summary_path: str | None = None
        #: The sync census of the last ``fit``: the syncs of one warm-up step, and whether it ran.
        self.syncs: tuple[SyncSite, ...] = ()
        self.sync_census: str | None = None

    # -- install / uninstall ------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        self._sync_wait_ns = self._fetch_ns = self._fetch_end = 0
        original = trainer.strategy.batch_to_device
        training = _training_stage(trainer)

        def batch_to_device(batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
            bounds = self._bounds
            stage = trainer.state.stage  # `trainer.training`, without its property and the enum's __eq__ each batch
            if bounds is None or (stage is not training and stage != training):
                return original(batch, device, dataloader_idx)
            self._on_batch(trainer, bounds)
            bounds.count_batch(batch)  # the step's samples/tokens and FLOPs, from shapes
            out = original(batch, device, dataloader_idx)
            bounds.on_copied()
            return out

        self._patch(trainer.strategy, "batch_to_device", batch_to_device)
        epoch_loop = trainer.fit_loop.epoch_loop
        # The training epoch loop hands these two to its data fetcher, which calls them
        # around each `next()` of the loader: the fetch boundary and `data_wait`.
        before, after = getattr(epoch_loop, "_on_before_fetch", None), getattr(epoch_loop, "_on_after_fetch", None)
        self._fetch_hooked = callable(before) and callable(after)
        if self._fetch_hooked:

            def on_before_fetch() -> None:
                if self._bounds is not None and not self._iter_mode:
                    self._bounds.on_fetch()
                self._fetch_t0 = time.perf_counter_ns()
                before()

            def on_after_fetch() -> None:
                after()
                now = time.perf_counter_ns()
                if self._iter_mode:  # inside the step: its data_wait, now
                    if self._bounds is not None:
                        self._bounds.core.add_host("data_wait", (now - self._fetch_t0) / 1e6)
                    return
                self._fetch_end = now
                self._fetch_ns += now - self._fetch_t0

            self._patch(epoch_loop, "_on_before_fetch", on_before_fetch)
            self._patch(epoch_loop, "_on_after_fetch", on_after_fetch)
        # Lightning 2.6 broadcasts a SIGTERM flag before every batch when distributed and
        # reads it back with `.item()`: the host waits there for the device and the other
        # ranks.  That wait is timed as `sync_wait`, outside the step and its data_wait.
        broadcast = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
        if callable(broadcast):

            def timed_broadcast(*args: Any, **kwargs: Any) -> Any:
                if self._bounds is not None:
                    self._bounds.fetch()  # the time between steps ends where the next batch's preparation begins
                t0 = time.perf_counter_ns()
                try:
                    return broadcast(*args, **kwargs)
                finally:
                    self._sync_wait_ns += time.perf_counter_ns() - t0

            self._patch(epoch_loop, "_broadcast_sigterm_tensor", timed_broadcast)

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
            outputs=self._outputs(trainer) if writes else None, trace_dir=trainer.default_root_dir,
            context=dict(precision=str(trainer.precision), optimizers=optimizer_info(trainer.optimizers)),
        )
        self.log_dir = self.core.log_dir  # this fit's
        bounds = self._bounds = Boundaries(
            self.core, no_end_hint="no torch optimizer step ended (an optimizer_step that never calls the optimizer?)"
        )
        self._trainer_ref = weakref.ref(trainer)
        # DDP's and FSDP2's waits for their collectives, split out (comm.py): DDPStrategy's module (its
        # ddp_comm_hook inside), a module sharded with fully_shard (ModelParallelStrategy's configure_model).
        self._comm = attach_comm([trainer.strategy.model], self.core)
        self._open_key = lifecycle.register(self._close_unclosed, sigterm=self.core.ranks is None)
        self._iter_mode = type(getattr(trainer.fit_loop, "_data_fetcher", None)).__name__ == "_DataLoaderIterDataFetcher"
        # trainer.optimizers are the torch optimizers themselves.  Their post-hook ends the
        # step.  Automatic optimization calls `optimizer.step(closure)` before it runs
        # training_step, so only manual optimization takes the pre-hook as `optimizer`.
        manual = not pl_module.automatic_optimization
        self._steps_total = _steps_count(trainer, manual)
        if manual:  # a raw `loss.backward()` fires no Lightning hook: heard at torch.autograd.backward
            self._raw_backward = _RawBackward(self, threading.get_ident())
            backward_calls.listen(self._raw_backward)
        self._hooks.append(
            StepHooks(trainer.optimizers, bounds.on_optimizer_start if manual else None, lambda opt: bounds.on_step_end(),
                      bounds.before_backward)
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and callable(getattr(scaler, "update", None)):
            self._patch(scaler, "update", ending_at(scaler.update, lambda: self._bounds))

    def _outputs(self, trainer: pl.Trainer) -> Any:
        """Every logger of the trainer (a TensorBoardLogger's writer straight, on a thread of its own), or
        without one, an event file of our own in ``log_dir``: a failure there warns and the run goes on."""

        def outputs(ranks: bool) -> Outputs:
            out = Outputs()
            tensorboard = _tensorboard_loggers(trainer)
            loggers = _loggers(trainer)
            for lg in loggers:
                if tensorboard and isinstance(lg, tensorboard):
                    layout = custom_scalars_layout(self.config.per_step, ranks)
                    writer = SummaryWriterSink(lg.experiment, owned=False, layout=layout)
                    out.sinks.append(BackgroundSink(writer, type(lg).__name__))
                    out.log_dir = lg.log_dir
                else:
                    out.sinks.append(GuardedSink(_LoggerSink(lg), type(lg).__name__))
            if not out.sinks and self.config.log_dir is not None:
                return own_event_file(os.fspath(self.config.log_dir), config=self.config, ranks=ranks, fail_fast=False)
            out.summary_dir = out.log_dir or _first_log_dir(loggers)
            return out

        return outputs

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
        """``trainer.global_step``, read as one attribute where it can be (``_steps_count``)."""
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
        lifecycle.unregister(self._open_key)
        self._open_key = None
        self._restore()
        comm, self._comm = self._comm, []
        for probe in comm:
            probe.remove(self.core)
        core, self.core = self.core, None
        bounds, self._bounds = self._bounds, None
        self._steps_total = self._trainer_ref = None  # the fit's own: nothing of it kept (or pickled) past its end
        # Lightning binds every callback's `log` and `log_dict` to the module's at each fit; kept past it, they would
        # keep the model, its gradients and its optimizer's state alive as long as the timer (a sweep keeps one a run).
        for name in ("log", "log_dict"):
            if getattr(self.__dict__.get(name), "__self__", self) is not self:
                del self.__dict__[name]
        if core is None or bounds is None:
            return
        bounds.finish(interrupted=interrupted)
        if trainer is not None:
            core.context["loader"] = _train_loader_info(trainer)
        # The one blocking wait: pending steps are resolved and written (and the other
        # ranks' last reports awaited, briefly when the run failed: a rank may be gone).
        core.finish(rank_timeout_s=self.config.rank_timeout_s, interrupted=interrupted, wait=wait)
        if self.config.summary or interrupted:
            self.last_summary = core.summary_table("phase-timer" + (" (interrupted)" if interrupted else ""))
            if (core.ranks is None or core.ranks.rank == 0 or oom.own(core)) and self.config.summary:
                print(self.last_summary, flush=True)
        self.totals = core.totals
        self.diagnosis, self.summary_path = core.diagnosis, core.summary_path
        self.syncs, self.sync_census = tuple(core.signals.syncs), core.signals.census

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


def _steps_count(trainer: pl.Trainer, manual: bool) -> Any:
    """The object whose ``completed`` is ``trainer.global_step``: one attribute read, where the property goes
    through six others (~1.5 µs a read in a real step, twice a batch).  Lightning's progress tracker of
    optimizer steps is kept in place through the fit (reset and restored field by field).  None where it is not
    found, or does not say what ``global_step`` says now: then the property itself is read."""
    try:
        loop = trainer.fit_loop.epoch_loop
        total = (loop.manual_optimization.optim_step_progress.total if manual
                 else loop.automatic_optimization.optim_progress.optimizer.step.total)
        return total if total.completed == trainer.global_step else None
    except AttributeError:
        return None


def _training_stage(trainer: pl.Trainer) -> Any:
    """``RunningStage.TRAINING`` of the namespace the Trainer comes from (``lightning.pytorch`` or
    ``pytorch_lightning``), for an identity test first (``trainer.training`` compares enums by value)."""
    module = type(trainer).__module__
    package = module[: module.index(".trainer")] if ".trainer" in module else "lightning.pytorch"
    try:
        return importlib.import_module(f"{package}.trainer.states").RunningStage.TRAINING
    except (ImportError, AttributeError):
        return "train"  # the enum's value: `!=` still compares right


def _loggers(trainer: pl.Trainer) -> list[Any]:
    """The trainer's loggers that keep what they are given: under ``fast_dev_run`` Lightning has put a
    ``DummyLogger`` in their place, which drops it (then only ``log_dir`` gets files)."""
    return [] if getattr(trainer, "fast_dev_run", False) else list(trainer.loggers)


def _first_log_dir(loggers: list[Any]) -> str | None:
    for lg in loggers:
        try:
            path = lg.log_dir
        except Exception:  # noqa: BLE001 - a logger without a directory
            continue
        if isinstance(path, str):
            return path
    return None


def _train_loader_info(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The training DataLoader's settings (the first one, when there are several)."""
    try:
        loaders = trainer.train_dataloader
    except Exception:  # noqa: BLE001 - not set up (the run failed early)
        return None
    if isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return loader_info(loaders)
