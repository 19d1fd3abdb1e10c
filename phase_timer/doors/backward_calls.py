"""The loop's ``backward()`` calls, seen where they are made: ``torch.autograd.backward``, wrapped.

``Tensor.backward`` looks ``torch.autograd.backward`` up at every call, and so
``loss.backward()``, ``scaler.scale(loss).backward()``, ``torch.autograd.backward(...)``
and the helpers that end in them (Lightning's, accelerate's) all pass through one
wrapper.  It is installed while at least one timer listens and put back when the
last one stops: one wrapper however many timers.

Why here and not on the autograd graph: a hook on the model output's ``grad_fn``
starts backward only when the gradient reaches the model, after the loss's own
backward (a cross-entropy over a large vocabulary is a millisecond of GPU work),
misses outputs the loss does not use, and leaves state behind when backward
raises.  The call itself has none of these problems, and costs one Python frame.

Calls are counted once: a call made while another is running on the same thread
(reentrant activation checkpointing runs ``torch.autograd.backward`` inside
backward) passes straight through, and each listener ignores calls from threads
other than its training loop's.  ``torch.autograd.grad`` is not a backward call:
it is counted in whatever phase calls it (``forward``, for a gradient penalty).

The timer must never break the training it measures: a listener that raises is
reported once and skipped, and the wrapper's own state is restored whatever happens.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Protocol

import torch

from phase_timer._env import warn

log = logging.getLogger(__name__)


class Listener(Protocol):
    def _backward_began(self) -> bool:
        """A backward call starts on this thread: True if this listener takes it (and wants its end)."""

    def _backward_ended(self, failed: bool) -> None:
        """The call it took returned, or raised (``failed``)."""


#: Weak references: a timer its loop never closed is still collected (and written then) once the loop drops it.
_listeners: tuple[weakref.ref[Listener], ...] = ()
_installed: Any = None  # what torch.autograd.backward was when the wrapper went in
_in_chain = False  # the wrapper is installed (maybe under another tool's wrapper of it)
_local = threading.local()
_warned = False


def _safely(call: Any, *args: Any) -> Any:
    """A listener's call; an error in it is reported once and never reaches the training loop."""
    global _warned
    try:
        return call(*args)
    except Exception as err:  # noqa: BLE001 - the timer must not break training
        if not _warned:
            _warned = True
            msg = f"phase-timer: a backward() boundary failed ({type(err).__name__}: {err}); training goes on"
            warn(log, msg, 3)
        return None


def _backward(*args: Any, **kwargs: Any) -> Any:
    original, listeners = _installed, _listeners
    if not listeners or getattr(_local, "depth", 0):
        return original(*args, **kwargs)
    _local.depth = 1
    took: list[Listener] = []
    failed = True
    try:
        took = [listener for ref in listeners if (listener := ref()) is not None
                and _safely(listener._backward_began)]
        out = original(*args, **kwargs)
        failed = False
        return out
    finally:
        _local.depth = 0
        for listener in took:  # also when backward raised: the next step starts clean
            _safely(listener._backward_ended, failed)


def listen(listener: Listener) -> None:
    """Start telling ``listener`` about backward calls (installs the wrapper if needed)."""
    global _listeners, _installed, _in_chain
    if not _in_chain:
        _installed = torch.autograd.backward  # whatever is there now: torch's, or another tool's wrapper
        torch.autograd.backward = _backward
        _in_chain = True
    _listeners = (*_listeners, weakref.ref(listener))


def unlisten(listener: Listener) -> None:
    """Stop telling ``listener``; the last one out puts back what the wrapper replaced."""
    global _listeners, _in_chain
    _listeners = tuple(x for x in _listeners if x() is not listener and x() is not None)
    if not _listeners and torch.autograd.backward is _backward:
        torch.autograd.backward = _installed
        _in_chain = False
    # If another tool wrapped ours since, its wrapper stays and ours, under it, passes
    # straight through; a later listen() finds ours still in the chain.


class RawBackward:
    """The backward calls a framework's own hooks do not bracket (Lightning's manual optimization: a raw
    ``loss.backward()`` in the step, not ``self.manual_backward``), told to ``timer``'s boundaries
    (``timer._bounds``): taken only where they are not in a backward already (the framework's hooks have it),
    on the training loop's thread (``thread``)."""

    def __init__(self, timer: Any, thread: int) -> None:
        self._timer, self._thread = timer, thread

    def _backward_began(self) -> bool:
        bounds = self._timer._bounds
        if bounds is None or bounds.in_backward or threading.get_ident() != self._thread:
            return False  # the framework's own hooks have it (Lightning's manual_backward)
        bounds.on_backward_start()
        return bounds.in_backward

    def _backward_ended(self, failed: bool) -> None:
        bounds = self._timer._bounds
        if bounds is not None:
            bounds.on_backward_end(failed)
