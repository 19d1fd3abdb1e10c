"""The plain-PyTorch door: ``attach()`` times a hand-written loop through PyTorch's own hooks.

:class:`LoopTimer` is the run: it checks what it is given, hooks the models, the optimizers,
``torch.autograd.backward`` and the loader (:mod:`phase_timer.doors.timed_loader`), and closes the
run however the loop ends.  Where each hook tells the boundaries what happened, and what each
one means here, is :mod:`phase_timer.doors.plain_hooks`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phase_timer.doors import backward_calls
from phase_timer.measures import oom
from phase_timer._env import warn
from phase_timer.doors.assemble import door_outputs, start_core
from phase_timer.doors.attach_args import check_attach, models_and_optimizers, no_end_hint
from phase_timer.run.boundaries import Boundaries, ending_at
from phase_timer.measures.comm import attach_comm
from phase_timer.config import disabled_by_env, reject_unknown
from phase_timer.run.core import TimingCore
from phase_timer.doors.door import Door, documented
from phase_timer.doors.optim_hooks import StepHooks, optimizer_info
from phase_timer.doors.options import Options
from phase_timer.patches import Patches
from phase_timer.doors.plain_hooks import PlainHooks
from phase_timer.runinfo import loader_info, precision_name
from phase_timer.timing.stats import RunTotals
from phase_timer.doors.timed_loader import TimedLoader
from phase_timer.outputs.user_sinks import check_sinks

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

_NONE: Callable[[], None] = lambda: None  # noqa: E731 - a dead weak reference's answer


@documented(run="the run", end="``close()``")
class LoopTimer(Door, PlainHooks):
    """What :func:`attach` returns: iterate ``timer.loader``, the rest is hooks.

    Use as a context manager (or call :meth:`close`) so the last steps are
    resolved and written even when the loop raises.

    Attributes (the results: after :meth:`close`; ``None`` before):
        loader: the wrapped loader to iterate (it times the fetch, and copies with
            ``copy_to_device=True``).
        {results}
    """

    __slots__ = ("__dict__", "__weakref__")  # beside the hooks' slots (PlainHooks)

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loader: Iterable[Any] | None,
        *,
        config: Options,
        device: torch.device | str | None,
        copy_to_device: bool,
        writer: SummaryWriter | None,
        end_step: str,
        scaler: Any,
        sinks: Sequence[Any] = (),
    ) -> None:
        self.models, self.optimizers = models_and_optimizers(models, optimizers)
        check_attach(self.optimizers, loader, device, writer, end_step, scaler, copy_to_device)
        self._user_sinks = check_sinks(config.owner, sinks)
        self.config = config
        self.enabled = config.enabled and not disabled_by_env()
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
        self.core: TimingCore | None = None
        #: An exception being handled where the timer was made (a retry inside an `except`): not this run's end.
        #: Held weakly: its traceback holds its frames, and their tensors.
        handled = sys.exc_info()[1]
        self._handled_at_start = weakref.ref(handled) if handled is not None else _NONE
        self._bounds: Boundaries | None = None
        # Disabled, the wrapper still copies when asked to: the loop relies on it.
        self.loader = TimedLoader(self, loader) if loader is not None and (self.enabled or copy_to_device) else loader
        if self.enabled:
            self.core = start_core(
                config, self.device, door="loop", window=config.window or 50, outputs=door_outputs(writer, config, self._user_sinks),
                context=dict(loader=loader_info(loader), optimizers=optimizer_info(self.optimizers)),
                models=self.models,
            )
            self.log_dir = self.core.log_dir
            self.is_rank_zero = self.core.ranks is None or self.core.ranks.rank == 0
            self._bounds = Boundaries(self.core, no_end_hint=no_end_hint(end_step))
            if self._bounds.flops is not None:  # a FLOP count starts on the loop's thread only, once it is known
                me = weakref.ref(self)
                self._bounds.flops.may_count = lambda: (t := me()) is not None and t._thread == threading.get_ident()
            self._hooks_in_c()
            self._install()
            # DDP's and FSDP2's waits for their collectives, split out of forward and backward (phase_timer/comm).
            self._comm = attach_comm(self.models, self.core)
            self._opened(self.core)
        else:
            self.totals = RunTotals()  # a disabled timer's results exist, and are empty

    def _first_param(self) -> torch.nn.Parameter | None:
        """The models' first parameter: its device is the default device, its dtype the weights' precision."""
        return next((p for model in self.models for p in model.parameters()), None)

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

    def detach(self) -> None:
        """Remove every hook: the model, optimizers, scaler and ``torch.autograd.backward`` are left as they were."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._drop_comm(self.__dict__.get("core"))
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
        self._closing()
        self.detach()
        self._hooks_in_python()
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
        return self._ended(core, interrupted=interrupted, wait=self._wait_at_close)

    def _caught(self, exc: BaseException | None) -> None:
        """An exception left the loop (or the Trainer's): an out-of-memory error is explained (``oom.caught``)."""
        oom.caught(exc, self.core, self._bounds, optimizers=self.optimizers, cut=self._cut)

    def _close_unclosed(self, interrupted: bool, why: str) -> None:
        """The run is still open at interpreter exit or on SIGTERM (:mod:`phase_timer.doors.lifecycle`): write it."""
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

    _wait_at_close = True  # False on SIGTERM's default: the one wait, for the device, is skipped
    _cut: oom.Cut | None = None  # where the boundaries were when the loader was last closed
    is_rank_zero: bool = True

    def __enter__(self) -> LoopTimer:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Leaving by an exception: under torch.distributed, wait for no other rank.
        self._caught(exc)
        self.close(interrupted=exc_type is not None)


@documented(run="the run", end="``close()``")
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
    modules: bool | int | Sequence[str] = False,
    **unknown: Any,
) -> LoopTimer:
    """Attach phase-timer to a hand-written loop; iterate ``timer.loader`` instead of the loader.

    A batch, for ``samples_per_batch``, ``tokens_per_batch`` and the FLOP count, is each one
    ``timer.loader`` hands over; where the loop makes its own batches, each training forward's
    inputs (a step's micro-batches summed; the FLOPs counted at its first forward).

    Args:
        model: the module(s) the loop calls for the training forward.
        optimizer: the optimizer(s); the step ends after the last one's ``step()``.
        loader: the training data loader (any iterable of batches).
        device: the device the work runs on (default: the model's).
        copy_to_device: the wrapper copies each batch to ``device`` (pinned, non-blocking).
        writer / log_dir: a SummaryWriter to write into, or a directory for our own
            (default ``phase-timer-logs/version_N``).
        window: steps per logging window.
        end_step: ``"optimizer"`` or ``"manual"`` (call ``timer.end_step()``).
        scaler: a GradScaler: the step then ends at ``scaler.update()``, skipped steps included.
        sinks: where else the values go, beside TensorBoard: a list of SummaryWriters, W&B runs
            (``wandb.init()``'s), MLflow runs (``mlflow.start_run()``'s, or the ``mlflow`` module:
            its active run), callables of ``(step, values)``, or sinks of your own (``write(step,
            values)``, ``flush()``, ``close()``); None entries are skipped.  What each writes,
            at which step, on which thread: ``docs/design.md``, "Where values go: sinks".
        {options}
    """
    reject_unknown("attach", attach, unknown)
    config = Options.of("attach", locals())
    return LoopTimer(
        model, optimizer, loader, config=config, device=device, copy_to_device=copy_to_device,
        writer=writer, end_step=end_step, scaler=scaler, sinks=sinks,
    )
