"""The plain door's hook bodies: where the loop tells ``LoopTimer`` each boundary happened.

What each phase means is defined once, in :mod:`phase_timer.run.boundaries`; here is
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
                    wrapped, :mod:`phase_timer.doors.backward_calls`)
optimizer           the optimizers' step pre-hooks (after backward: at once)
step end            each optimizer's step post-hook, ``scaler.update()`` when a
                    GradScaler is given, or ``timer.end_step()`` (``end_step="manual"``);
                    without a loader, only the last optimizer's post-hook
pause               a forward with grad disabled in eval mode (or between steps):
                    evaluation, neither in a step nor in ``period``
==================  ===============================================================

The bodies test the usual case first (the loop's thread, known), then the full rule: a few µs a
step in a real loop, where every attribute and call costs several times its price in a hot loop.
Where C is built, ``_native.LoopHooks`` does the usual case of six of them in one call
(:meth:`PlainHooks._hooks_in_c`) and calls these for anything else: they stay the one definition.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import weakref
from threading import get_ident
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phase_timer.measures import oom
from phase_timer._env import native_wanted, warn_once
from phase_timer.measures.comm.run import CARRIED as COMM_CARRIED
from phase_timer.phases import BETWEEN, HOST_PHASES, PAUSED, STEP_PHASES, TOTALS
from phase_timer.measures.step_flops import CARRIED as FLOP_VALUES
from phase_timer.measures.throughput import COUNTS, first_tensor

if TYPE_CHECKING:
    from phase_timer.run.boundaries import Boundaries
    from phase_timer.run.core import TimingCore

log = logging.getLogger(__name__)

try:
    from phase_timer._native import LoopHooks as _LoopHooks
except ImportError:  # not built: the hooks are the methods themselves
    _LoopHooks = None

#: The hook bodies that LoopHooks does in C in the usual case (each calls its method for any other).
_HOOK_BODIES = ("_fetch", "_on_batch", "_on_forward", "_backward_began", "_backward_ended", "_on_optimizer_end")

_grad_enabled = torch.is_grad_enabled
#: A built-in's name would merge into it; a carried value's (throughput's, FLOPs', communication's) would be taken out of it.
_RESERVED = HOST_PHASES | set(TOTALS) | set(STEP_PHASES) | {BETWEEN, PAUSED, *COUNTS, *FLOP_VALUES, *COMM_CARRIED}


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch to ``device``: pinned, non-blocking."""
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cpu" and device.type == "cuda" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


class PlainHooks:
    """The hook bodies of :class:`phase_timer.doors.loop.LoopTimer`, which installs them and sets their state."""

    #: The state every hook reads, in slots (the rest in ``__dict__``): the C hooks (``_native.LoopHooks``) read it
    #: here too, the same values, by these names in the order of ``native/loop_hooks.c``'s enum.
    HOOK_SLOTS = ("_bounds", "_thread", "_loader_active", "_end_on_optimizer", "_copy")
    __slots__ = HOOK_SLOTS
    _bounds: Boundaries | None
    _thread: int | None
    _loader_active: bool
    _end_on_optimizer: bool
    _copy: bool
    _loader_thread: int | None
    _warned: set[str]
    _cut: oom.Cut | None
    core: TimingCore | None
    device: torch.device
    optimizers: list[torch.optim.Optimizer]

    def _hooks_in_c(self) -> None:
        """Each hook body's usual case in one C call (``_native.LoopHooks``), where it is built: these methods stay
        the one definition, and the C ones call them for anything else.  An instance attribute each, so that the
        hooks installed and the loader wrapper take them (in a real loop a Python body costs ~1-2 µs of frames and
        attribute lookups: ``docs/benchmarks.md``)."""
        if _LoopHooks is None or not native_wanted():
            return
        own = tuple(getattr(type(self), name).__get__(self) for name in _HOOK_BODIES)
        hooks = _LoopHooks(self, self._bounds, _grad_enabled, time, own)
        for name, fn in zip(_HOOK_BODIES, (hooks.fetch, hooks.on_batch, hooks.forward, hooks.backward_began,
                                           hooks.backward_ended, hooks.optimizer_end)):
            setattr(self, name, fn)

    def _hooks_in_python(self) -> None:
        """The run's end: the C hooks hold the boundaries (and the timer: a cycle), so they go with it."""
        for name in _HOOK_BODIES:
            self.__dict__.pop(name, None)  # type: ignore[attr-defined] - the timer's (LoopTimer has one)

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
            batch = to_device(batch, self.device)
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

    # -- the loop's own calls -----------------------------------------------------------
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


class _PhaseContext(contextlib.ContextDecorator):
    """``timer.phase(name)``: safe to re-enter (recursion) and to use from several threads."""

    def __init__(self, timer: PlainHooks, name: str) -> None:
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
