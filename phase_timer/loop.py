"""The plain-PyTorch door: ``attach()`` times a hand-written loop through PyTorch's own hooks.

What each phase means is defined once, in :mod:`phase_timer.boundaries`; here is
where the loop tells us each boundary happened:

==================  ===============================================================
boundary            hook
==================  ===============================================================
fetch               the loop asks the wrapped loader for the next batch; ``data_wait``
                    is the host time inside its ``next()``
batch (``h2d``)     the loader hands over a batch (``copy_to_device=True``: the
                    wrapper copies it, then ``forward``)
forward             the attached module's forward pre-hook
backward            the loop's ``backward()`` call .. its return (``torch.autograd.backward``
                    wrapped, :mod:`phase_timer.backward_calls`)
optimizer           the optimizers' step pre-hooks (after backward: at once)
step end            each optimizer's step post-hook, ``scaler.update()`` when a
                    GradScaler is given, or ``timer.end_step()`` (``end_step="manual"``);
                    without a loader, only the last optimizer's post-hook
pause               a forward with grad disabled in eval mode (or between steps):
                    evaluation, neither in a step nor in ``period``
==================  ===============================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from threading import get_ident
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phase_timer import backward_calls, lifecycle, oom
from phase_timer._env import native_wanted, warn, warn_once
from phase_timer.assemble import Outputs, own_event_file, start_core
from phase_timer.boundaries import Boundaries, ending_at
from phase_timer.config import DEFAULT_LOG_DIR, TimerConfig, _fail, check_bool, disabled_by_env, reject_unknown
from phase_timer.core import CARRIED, TimingCore
from phase_timer.diagnosis import Diagnosis
from phase_timer.phases import BETWEEN, HOST_PHASES, PAUSED, STEP_PHASES, TOTALS
from phase_timer.tags import custom_scalars_layout
from phase_timer.throughput import first_tensor
from phase_timer.optim_hooks import StepHooks
from phase_timer.patches import Patches
from phase_timer.runinfo import loader_info, optimizer_info, precision_name
from phase_timer.sinks import BackgroundSink, SummaryWriterSink, next_version_dir
from phase_timer.stats import RunTotals
from phase_timer.comm import attach_comm
from phase_timer.syncs import SyncSite
from phase_timer.user_sinks import check_sinks, with_user_sinks

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

_grad_enabled = torch.is_grad_enabled

try:
    from phase_timer._native import LoopHooks as _LoopHooks
except ImportError:  # not built: the hooks are the methods themselves
    _LoopHooks = None

#: The hook bodies that LoopHooks does in C in the usual case (each calls its method for any other).
_HOOK_BODIES = ("_fetch", "_on_batch", "_on_forward", "_backward_began", "_backward_ended", "_on_optimizer_end")

_NONE: Callable[[], None] = lambda: None  # noqa: E731 - a dead weak reference's answer
_RESERVED = HOST_PHASES | set(TOTALS) | set(STEP_PHASES) | {BETWEEN, PAUSED, *CARRIED}  # a built-in's name would merge into it
_END_STEP = ("optimizer", "manual")


def _to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch to ``device``: pinned, non-blocking."""
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cpu" and device.type == "cuda" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


class _TimedLoader:
    """Iterates the user's loader: each fetch, the wait for each batch, the loader's end."""

    def __init__(self, timer: LoopTimer, loader: Iterable[Any]) -> None:
        self._timer = timer
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        timer = self._timer
        if timer.__dict__.get("_closed"):
            warn(log, "phase-timer: timer.loader is iterated after the timer was closed: these batches are not timed "
                      "(attach a new timer for a new run)", 2)
        it = iter(self._loader)
        fetch, on_batch = timer._fetch, timer._on_batch
        core, bounds = timer.core, timer._bounds
        count = bounds.count_batch if bounds is not None and core is not None and (core.counter or core.flops) else None
        try:
            while True:
                fetch()
                t0 = time.perf_counter_ns()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                out = on_batch(batch, t0)
                if count is not None and timer._loader_active:  # the step's samples/tokens and FLOPs, from shapes
                    count(batch)
                yield out
        finally:  # the loader ran out, or the loop left it (break, an exception): a cut-off step is dropped
            timer._epoch_end()

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class LoopTimer:
    """What :func:`attach` returns: iterate ``timer.loader``, the rest is hooks.

    Use as a context manager (or call :meth:`close`) so the last steps are
    resolved and written even when the loop raises.

    Attributes:
        loader: the wrapped loader to iterate (it times the fetch, and copies with
            ``copy_to_device=True``).
        totals: after :meth:`close`, a :class:`phase_timer.stats.RunTotals` of every timed step.
        last_summary: after :meth:`close`, the summary table as printed (rank zero).
        diagnosis: after :meth:`close`, the verdict, a :class:`phase_timer.Diagnosis` (rank zero).
        summary_path: where rank zero wrote ``phase_timer_summary.json`` (None: not written).
        log_dir: the directory the TensorBoard values go to (the writer's, or our own).
        syncs: after :meth:`close`, the host-device syncs of one warm-up step, each a
            :class:`phase_timer.syncs.SyncSite` (phase, where, code, count, known cause);
            ``sync_census`` says whether the census ran, or why not.
    """

    # Slots: the state every hook reads (the C hooks read it here too, the same values); the rest in __dict__.
    __slots__ = ("_bounds", "_thread", "_loader_active", "_end_on_optimizer", "_copy", "__dict__", "__weakref__")

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loader: Iterable[Any] | None,
        *,
        config: TimerConfig,
        device: torch.device | str | None,
        copy_to_device: bool,
        writer: SummaryWriter | None,
        end_step: str,
        scaler: Any,
        enabled: bool,
        sinks: Sequence[Any] = (),
    ) -> None:
        if isinstance(models, torch.optim.Optimizer) and isinstance(optimizers, nn.Module):
            _fail("attach", "model", models, "an nn.Module or a list of them",
                  ": the model and the optimizer are swapped, attach(model, optimizer)")
        self.models = _checked_list(models, nn.Module, "model", "an nn.Module or a list of them")
        optimizers = () if optimizers is None else optimizers  # no optimizer: end_step="manual"
        self.optimizers = _checked_list(optimizers, torch.optim.Optimizer, "optimizer",
                                        "a torch.optim.Optimizer, a list of them, or None with end_step='manual'",
                                        empty_ok=True)
        _check_attach_args(self.optimizers, loader, device, writer, end_step, scaler, copy_to_device, enabled)
        self._user_sinks = check_sinks(config.owner, sinks)
        self.config = config
        self.enabled = enabled and not disabled_by_env()
        first = self._first_param()
        self.device = torch.device(device) if device is not None else first.device if first is not None else torch.device("cpu")
        self._copy = copy_to_device
        self._end_on_optimizer = end_step == "optimizer"
        self._handles: list[Any] = []
        self._scaler, self._patches = scaler, Patches()
        self._listening = False
        #: The training loop's thread, bound at the model's first forward or the first backward()
        #: call: hooks, backward calls and phases from other threads are not its steps.
        self._thread: int | None = None
        self._loader_thread: int | None = None  # where timer.loader was last iterated
        #: The loader's fetches are the loop's (False once it is found iterated on another thread).
        self._loader_active = loader is not None
        self._warned: set[str] = set()
        self.log_dir: str | None = None
        self.core: TimingCore | None = None
        self._open_key: int | None = None  # registered with lifecycle while the run is open
        #: An exception being handled where the timer was made (a retry inside an `except`): not this run's end.
        #: Held weakly: its traceback holds its frames, and their tensors.
        handled = sys.exc_info()[1]
        self._handled_at_start = weakref.ref(handled) if handled is not None else _NONE
        self._bounds: Boundaries | None = None
        # Disabled, the wrapper still copies when asked to: the loop relies on it.
        self.loader = _TimedLoader(self, loader) if loader is not None and (self.enabled or copy_to_device) else loader
        if self.enabled:
            self.core = start_core(
                config, self.device, door="loop", window=config.window or 50, outputs=self._outputs(writer),
                context=dict(loader=loader_info(loader), optimizers=optimizer_info(self.optimizers)),
            )
            self.log_dir = self.core.log_dir
            self.is_rank_zero = self.core.ranks is None or self.core.ranks.rank == 0
            hint = (
                "call timer.end_step() where each step ends (end_step='manual')" if end_step == "manual" else
                "the attached optimizers' step() never ran; attach the optimizer the loop steps (an optimizer "
                "that steps another is followed through its `base_optimizer`), or use end_step='manual'"
            )
            self._bounds = Boundaries(self.core, no_end_hint=hint)
            if self.core.flops is not None:  # a FLOP count starts on the loop's thread only, once it is known
                me = weakref.ref(self)
                self.core.flops.may_count = lambda: (t := me()) is not None and t._thread == threading.get_ident()
            self._hooks_in_c()
            self._install()
            # DDP's and FSDP2's waits for their collectives, split out of forward and backward (comm.py).
            self._comm = attach_comm(self.models, self.core)
            self._open_key = lifecycle.register(self._close_unclosed, sigterm=self.core.ranks is None)
        else:
            self.totals = RunTotals()  # a disabled timer's results exist, and are empty

    def _first_param(self) -> torch.nn.Parameter | None:
        """The models' first parameter: its device is the default device, its dtype the weights' precision."""
        return next((p for model in self.models for p in model.parameters()), None)

    def _outputs(self, writer: SummaryWriter | None) -> Any:
        """Where rank zero's values go: the user's SummaryWriter, or an event file of our own in
        ``log_dir`` (default ``phase-timer-logs/version_N``); a directory that cannot be written fails here."""

        def outputs(ranks: bool) -> Outputs:
            if writer is not None:
                layout = custom_scalars_layout(self.config.per_step, ranks)
                sink = BackgroundSink(SummaryWriterSink(writer, owned=False, layout=layout), "SummaryWriter")
                return Outputs([sink], writer.log_dir, writer.log_dir)
            log_dir = next_version_dir(self.config.log_dir or DEFAULT_LOG_DIR)
            return own_event_file(log_dir, config=self.config, ranks=ranks, fail_fast=True)

        return with_user_sinks(outputs, self._user_sinks, self.config.owner)

    # -- hooks ----------------------------------------------------------------------
    def _install(self) -> None:
        for model in self.models:
            # first of the model's pre-hooks (a user's registered before attach is forward's work, not h2d's); with
            # its keywords: a loop without a loader counts a forward's inputs, ``model(input_ids=...)`` too
            self._handles.append(model.register_forward_pre_hook(self._on_forward, prepend=True, with_kwargs=True))
        bounds = self._bounds
        assert bounds is not None
        self._handles.append(StepHooks(self.optimizers, bounds.on_optimizer_start, self._on_optimizer_end,
                                       bounds.before_backward))
        backward_calls.listen(self)
        self._listening = True
        if self._scaler is not None:
            self._patches.replace(self._scaler, "update", ending_at(
                self._scaler.update, lambda: self._bounds if self._end_on_optimizer else None))

    def _hooks_in_c(self) -> None:
        """Each hook body's usual case in one C call (``_native.LoopHooks``), where it is built: the methods below
        stay the one definition, and the C ones call them for anything else.  An instance attribute each, so
        that the hooks installed and the loader wrapper take them (in a real loop a Python body costs ~1-2 µs
        of frames and attribute lookups: ``docs/benchmarks.md``)."""
        if _LoopHooks is None or not native_wanted():
            return
        own = tuple(getattr(type(self), name).__get__(self) for name in _HOOK_BODIES)
        hooks = _LoopHooks(self, self._bounds, _grad_enabled, time, own)
        for name, fn in zip(_HOOK_BODIES, (hooks.fetch, hooks.on_batch, hooks.forward, hooks.backward_began,
                                           hooks.backward_ended, hooks.optimizer_end)):
            setattr(self, name, fn)

    def _loader_here(self) -> bool:
        """The loader is iterated on the training loop's thread (else its fetches are not the loop's)."""
        if not self._loader_active:
            return False
        ident = threading.get_ident()
        if self._thread is None:  # not known yet: the first forward or backward() will say
            self._loader_thread = ident
            return True
        if ident == self._thread:
            return True
        self._loader_elsewhere()
        return False

    def _loader_elsewhere(self) -> None:
        """timer.loader runs on another thread (a prefetching wrapper): time steps as without a loader."""
        self._loader_active = False
        if self._bounds is not None:
            self._bounds.drop()
        self._warn_once(
            "loader thread",
            "phase-timer: timer.loader is iterated on a thread other than the training loop's (a prefetching "
            "wrapper around it?), so its fetches are not the loop's: data_wait and h2d are not timed and each "
            "step begins at the model's forward. Attach the loader the loop iterates instead, e.g. "
            "attach(model, opt, BackgroundGenerator(loader)).",
        )

    def _warn_once(self, key: str, msg: str) -> None:
        warn_once(log, self._warned, key, msg, 4)

    # The hooks below test the usual case first (the loop's thread, known), then the full rule: a few µs a
    # step in a real loop, where every attribute and call costs several times its price in a hot loop.
    def _fetch(self) -> None:
        bounds = self._bounds
        if bounds is not None and (self._loader_active and get_ident() == self._thread or self._loader_here()):
            bounds.on_fetch()

    def _on_batch(self, batch: Any, t0: int) -> Any:
        bounds = self._bounds
        timed = bounds is not None and (self._loader_active and get_ident() == self._thread or self._loader_here())
        if timed:
            bounds.on_batch(None, (time.perf_counter_ns() - t0) / 1e6)
        if self._copy:
            batch = _to_device(batch, self.device)
            if timed:
                bounds.on_copied()
        return batch

    def _epoch_end(self) -> None:
        if self._bounds is not None and self._loader_here():
            # An exception in the loop closes the loader before the door hears of it, and the close moves the
            # boundaries on: where they were, and the frame closing it, for an out-of-memory error's finding.
            self._cut = oom.cut(self._bounds, sys._getframe(2))
            self._bounds.epoch_end()

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        bounds = self._bounds
        if bounds is None or bounds.in_backward:
            return
        if get_ident() != self._thread and not self._on_loop_thread():
            return
        if not _grad_enabled() and (not module.training or not bounds.open or bounds.trailing):
            bounds.pause()  # evaluation: in eval mode, or between steps
            return
        if self._loader_active:
            bounds.on_forward()
        else:  # no loader: the forward begins the step; its inputs are a micro-batch (throughput's counts, summed
            bounds.forward(begins=True)  # over the step's training forwards) and, at the step's first, its FLOPs
            batch = (*args, kwargs) if kwargs else args
            bounds.count_batch(batch, samples=self._new_inputs(batch, bounds.begun))

    def _new_inputs(self, batch: Any, step: int) -> bool:
        """A training forward's inputs are a new micro-batch unless they are the tensor this step's last forward
        took (SAM's second pass, LBFGS's re-evaluations, a closure called again: the same batch, counted once)."""
        first = first_tensor(batch)
        seen = self.__dict__.get("_last_inputs")
        again = first is not None and seen is not None and seen[0] == step and seen[1]() is first
        self._last_inputs = (step, weakref.ref(first)) if first is not None else None
        return not again

    def _on_loop_thread(self) -> bool:
        """True on the training loop's thread: the first forward or backward() call binds it."""
        ident = threading.get_ident()
        if self._thread is None:
            self._thread = ident
            if self._loader_active and self._loader_thread not in (None, ident):
                self._loader_elsewhere()
        return ident == self._thread

    def _backward_began(self) -> bool:
        bounds = self._bounds
        if bounds is None or (get_ident() != self._thread and not self._on_loop_thread()):
            return False
        bounds.on_backward_start()
        return bounds.in_backward

    def _backward_ended(self, failed: bool) -> None:
        if self._bounds is not None:
            self._bounds.on_backward_end(failed)

    def _on_optimizer_end(self, opt: torch.optim.Optimizer) -> None:
        # With a loader, any optimizer step may be the batch's last (the next fetch says);
        # without one, the last optimizer given ends the step.
        if self._end_on_optimizer and self._bounds is not None and (self._loader_active or opt is self.optimizers[-1]):
            self._bounds.on_step_end()

    # -- public ---------------------------------------------------------------------
    def end_step(self) -> None:
        """End the running step here (with ``end_step="manual"``; else the optimizer step ends it).

        What follows, until the loop fetches the next batch, is ``between_steps``.
        """
        if self._bounds is not None:
            self._bounds.step_end()

    def phase(self, name: str) -> _PhaseContext:
        """Time a named region: ``with timer.phase("clip"): ...`` or ``@timer.phase("ema")``.

        The innermost open phase owns the time (nesting is exclusive, so phases still
        add up); built-in boundaries inside it take effect when it closes.  Inside a
        step it is part of ``step`` under its own name (its share is of ``step``); after
        the step's end (an EMA after ``optimizer.step()``, or the rest of a phase left open
        across it) its time is ``between_steps.<name>``, part of ``period`` but not of
        ``step``.  Only the training loop's thread is timed; re-entry (recursion) is
        counted once.
        """
        if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
            raise ValueError(
                f"timer.phase(name={name!r}): `name` must be an identifier other than "
                f"{sorted(_RESERVED)}, got {name!r}"
            )
        return _PhaseContext(self, name)

    def _enter(self, name: str) -> bool:
        """A user phase opens on this thread: True if it is timed."""
        if self._bounds is None:
            return False
        if self._thread is not None and threading.get_ident() != self._thread:
            self._warn_once(
                "phase thread",
                f"phase-timer: timer.phase({name!r}) was entered on a thread other than the training loop's; "
                "phases are timed on the loop's thread only, so this one is not timed",
            )
            return False
        self._bounds.enter(name)
        return True

    def _exit(self) -> None:
        if self._bounds is not None:
            self._bounds.exit()

    def detach(self) -> None:
        """Remove every hook: the model, optimizers, scaler and ``torch.autograd.backward`` are left as they were."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for probe in self.__dict__.pop("_comm", ()):
            probe.remove(self.__dict__.get("core"))
        if self._listening:
            backward_calls.unlisten(self)
            self._listening = False
        if self._scaler is not None:
            # Put back what was there, unless something wrapped ours since: then ours stays,
            # passing straight through (no timer is left behind it).
            self._patches.put_back()
            self._scaler = None

    def close(self, *, interrupted: bool = False) -> RunTotals | None:
        """Detach, resolve what is pending (the one wait for the device), write, print the summary.

        ``interrupted`` (set when the ``with`` block raises): under torch.distributed,
        send no last report and wait for no other rank.
        """
        # close() in a `finally` or an `except` of the loop's error (not of one handled since before the run began)
        handled = sys.exc_info()[1]
        if handled is not None and handled is not self._handled_at_start() and self.core is not None:
            self._caught(handled)
        interrupted = interrupted or (self.core is not None and self.core.oom is not None)
        lifecycle.unregister(self._open_key)
        self._open_key = None
        self.detach()
        for name in _HOOK_BODIES:  # the C hooks hold the boundaries (and this timer: a cycle): gone with them
            self.__dict__.pop(name, None)
        core, self.core = self.core, None
        bounds, self._bounds = self._bounds, None
        if core is None or bounds is None:
            return self.totals
        self._closed = True  # timer.loader iterated from now on says so
        bounds.finish(interrupted=interrupted)
        if not interrupted and bounds.begun == 0 and self._thread is not None and self._loader_active:
            core.untimed_reason = "the model trained, but no batch came through timer.loader"
            self._warn_once("no batch", "phase-timer: no step was timed: the model trained, but no batch came "
                            "through timer.loader; iterate timer.loader (the wrapped loader), not the loader passed to attach()")
        ctx = core.context
        first = self._first_param()
        ctx["precision"] = precision_name(first.dtype if first is not None else None, ctx.pop("autocast", None))
        self.totals = core.finish(rank_timeout_s=self.config.rank_timeout_s, interrupted=interrupted,
                                  wait=self._wait_at_close)
        self.diagnosis, self.summary_path = core.diagnosis, core.summary_path
        self.syncs, self.sync_census = tuple(core.signals.syncs), core.signals.census
        self.last_summary = core.summary_table("phase-timer" + (" (interrupted)" if interrupted else ""))
        if self.config.summary and (self.is_rank_zero or oom.own(core)):  # a rank that ran out says so too
            print(self.last_summary, flush=True)
        return self.totals

    def _caught(self, exc: BaseException | None) -> None:
        """An exception left the loop (or the Trainer's): an out-of-memory error is explained (``oom.caught``)."""
        oom.caught(exc, self.core, self._bounds, optimizers=self.optimizers, cut=self._cut)

    def _close_unclosed(self, interrupted: bool, why: str) -> None:
        """The run is still open at interpreter exit or on SIGTERM (:mod:`phase_timer.lifecycle`): write it."""
        if self.core is None:
            return
        if why == "on SIGTERM":  # a preemption is no mistake of the user's: the table says "interrupted"
            self._wait_at_close = False  # the process ends next: no wait for the device (it may be stuck)
        else:
            warn(log, f"phase-timer: the timer was never closed, so what it measured is written {why}; leave a "
                      "`with phase_timer.attach(...) as timer:` block or call timer.close() where training ends", 2)
            if interrupted:  # the uncaught exception that ends the program (set before the exit handlers run)
                self._caught(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
        self.close(interrupted=interrupted)

    def __del__(self) -> None:
        # Collected while open (the loop, its model and optimizer all dropped without close()): write it, once.
        # The collector may run anywhere (another run's step, another thread): no wait for the device nor for
        # other ranks, so it never holds up what happens to be running.
        try:
            if getattr(self, "core", None) is not None:
                self._wait_at_close = False
                self._close_unclosed(True, "when the timer was garbage collected")
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    totals: RunTotals | None = None
    last_summary: str | None = None
    _wait_at_close = True  # False on SIGTERM's default: the one wait, for the device, is skipped
    _cut: oom.Cut | None = None  # where the boundaries were when the loader was last closed
    #: The verdict (:class:`phase_timer.Diagnosis`), set by :meth:`close`.
    diagnosis: Diagnosis | None = None
    #: Where rank zero wrote ``phase_timer_summary.json`` (None: not written).
    summary_path: str | None = None
    #: The sync census: the syncs of one warm-up step (set by :meth:`close`), and whether it ran.
    syncs: tuple[SyncSite, ...] = ()
    sync_census: str | None = None
    is_rank_zero: bool = True

    def __enter__(self) -> LoopTimer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Leaving by an exception: under torch.distributed, wait for no other rank.
        self._caught(exc)
        self.close(interrupted=exc_type is not None)


class _PhaseContext(contextlib.ContextDecorator):
    """``timer.phase(name)``: safe to re-enter (recursion) and to use from several threads."""

    def __init__(self, timer: LoopTimer, name: str) -> None:
        self._timer, self._name = timer, name
        self._local = threading.local()  # per thread: the nesting depth, and whether the outer entry was timed

    def __enter__(self) -> None:
        local = self._local
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        if depth == 0:  # a recursive entry is already inside this phase
            local.timed = self._timer._enter(self._name)

    def __exit__(self, *exc: Any) -> None:
        local = self._local
        local.depth -= 1
        if local.depth == 0 and local.timed:
            self._timer._exit()


def _checked_list(value: Any, kind: type, name: str, expected: str, *, empty_ok: bool = False) -> list[Any]:
    """``value`` as a list of ``kind`` (one, or a list or tuple of them), or a ValueError naming it as given."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, kind) for v in value) and (value or empty_ok):
        return list(value)
    _fail("attach", name, value, expected)


def _check_attach_args(optimizers: list[Any], loader: Any, device: Any, writer: Any, end_step: Any, scaler: Any,
                       copy: Any, enabled: Any) -> None:
    """Everything attach() takes besides the config, checked before anything is hooked."""
    for name, value in (("copy_to_device", copy), ("enabled", enabled)):
        check_bool("attach", name, value)
    if end_step not in _END_STEP:
        _fail("attach", "end_step", end_step, f"one of {_END_STEP}")
    if end_step == "optimizer" and not optimizers and scaler is None:
        _fail("attach", "optimizer", optimizers or None, "given: a step ends at its step(); or pass "
              "end_step='manual' and call timer.end_step()")
    if loader is not None and (isinstance(loader, (str, bytes)) or not hasattr(loader, "__iter__")):
        _fail("attach", "loader", loader, "an iterable of batches (a DataLoader) or None")
    if copy and loader is None:
        _fail("attach", "copy_to_device", copy, "False without a loader", " (there is no batch to copy)")
    _check_device(device)
    if writer is not None and not callable(getattr(writer, "add_scalar", None)):
        _fail("attach", "writer", writer, "a torch.utils.tensorboard.SummaryWriter or None")
    if scaler is not None:
        if not isinstance(scaler, torch.amp.GradScaler):
            _fail("attach", "scaler", scaler, "a torch.amp.GradScaler or None")
        if end_step != "optimizer":
            _fail("attach", "scaler", scaler, "None with end_step='manual'",
                  " (the scaler only ends steps at its update(); with end_step='manual' you end them)")


def _check_device(device: Any) -> None:
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        _fail("attach", "device", device, "a torch.device, a device string such as 'cuda:0', or None", f" ({err})")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            _fail("attach", "device", device, "a device this machine has", " (CUDA is not available)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            _fail("attach", "device", device, "a device this machine has",
                  f" (it has {torch.cuda.device_count()} CUDA device(s))")


def attach(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    loader: Iterable[Any] | None = None,
    *,
    device: torch.device | str | None = None,
    copy_to_device: bool = False,
    writer: SummaryWriter | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    window: int = 50,
    warmup_steps: int = 5,
    max_pending: int = 64,
    per_step: bool = False,
    summary: bool = True,
    end_step: str = "optimizer",
    scaler: Any = None,
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
    sinks: Sequence[Any] = (),
    memory_snapshot: bool | str | os.PathLike[str] | None = None,
    **unknown: Any,
) -> LoopTimer:
    """Attach phase-timer to a hand-written loop; iterate ``timer.loader`` instead of the loader.

    Args:
        model: the module(s) the loop calls for the training forward.
        optimizer: the optimizer(s); the step ends after the last one's ``step()``.
        loader: the training data loader (any iterable of batches).
        device: the device the work runs on (default: the model's).
        copy_to_device: the wrapper copies each batch to ``device`` (pinned, non-blocking).
        writer / log_dir: a SummaryWriter to write into, or a directory for our own
            (default ``phase-timer-logs/version_N``).
        window, warmup_steps, max_pending, per_step, summary: as for ``PhaseTimer``.
        end_step: ``"optimizer"`` or ``"manual"`` (call ``timer.end_step()``).
        scaler: a GradScaler: the step then ends at ``scaler.update()``, skipped steps included.
        nvtx: also push each phase as an NVTX range (Nsight Systems); off by default.
        trace_steps, trace_path: write a Chrome/Perfetto trace of steps ``first..stop-1``
            on the device's timeline (default ``<log_dir>/phase_trace.json``), on close.
        rank_timeout_s: under torch.distributed, how long ``close()`` waits for the other
            ranks' last reports (not at all when the ``with`` block raised).
        memory: as for ``PhaseTimer``: memory per phase on CUDA, sampled, never a sync.
        samples_per_batch, tokens_per_batch: as for ``PhaseTimer``: throughput's counts of a batch
            (default: from the shapes of each batch ``timer.loader`` hands over; where the loop makes its own
            batches, of each training forward's inputs, the step's micro-batches summed).
        flops_per_step, peak_tflops, mfu: as for ``PhaseTimer``: FLOPs and MFU (counted on an untimed step per
            batch shape that ``timer.loader`` hands over, or without one the first forward's inputs; ``docs/flops.md``).
        enabled: ``False`` (or ``PHASE_TIMER_DISABLE=1``) attaches nothing.  Under
            torch.distributed it must be the same on every rank (rank zero expects every
            rank's reports); only rank zero writes anyway.
        sinks: where else the values go, beside TensorBoard: a list of SummaryWriters, W&B runs
            (``wandb.init()``'s), MLflow runs (``mlflow.start_run()``'s, or the ``mlflow`` module:
            its active run), callables of ``(step, values)``, or sinks of your own (``write(step,
            values)``, ``flush()``, ``close()``); None entries are skipped.  What each writes,
            at which step, on which thread: ``docs/design.md``, "Where values go: sinks".
        memory_snapshot: as for ``PhaseTimer``: record the CUDA allocator's history and dump a snapshot
            on an out-of-memory error (``True``: in the log directory; ``"end"``: also at the end; a path).
    """
    reject_unknown("attach", attach, unknown)
    config = TimerConfig(
        window=window, warmup_steps=warmup_steps, max_pending=max_pending, per_step=per_step,
        summary=summary, log_dir=log_dir, nvtx=nvtx, trace_steps=trace_steps, trace_path=trace_path,
        rank_timeout_s=rank_timeout_s, memory=memory, samples_per_batch=samples_per_batch,
        tokens_per_batch=tokens_per_batch, flops_per_step=flops_per_step, peak_tflops=peak_tflops, mfu=mfu,
        memory_snapshot=memory_snapshot, owner="attach",
    )
    return LoopTimer(
        model, optimizer, loader, config=config, device=device, copy_to_device=copy_to_device,
        writer=writer, end_step=end_step, scaler=scaler, enabled=enabled, sinks=sinks,
    )
