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
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch


class Listener(Protocol):
    def _backward_began(self) -> bool:
        """A backward call starts on this thread: True if this listener takes it (and wants its end)."""

    def _backward_ended(self, failed: bool) -> None:
        """The call it took returned, or raised (``failed``)."""


_listeners: tuple[Listener, ...] = ()
_original: Any = None
_local = threading.local()


def _backward(*args: Any, **kwargs: Any) -> Any:
    listeners = _listeners
    if not listeners or getattr(_local, "depth", 0):
        return _original(*args, **kwargs)
    _local.depth = 1
    took = [listener for listener in listeners if listener._backward_began()]
    failed = True
    try:
        out = _original(*args, **kwargs)
        failed = False
        return out
    finally:
        _local.depth = 0
        for listener in took:  # also when backward raised: the next step starts clean
            listener._backward_ended(failed)


def listen(listener: Listener) -> None:
    """Start telling ``listener`` about backward calls (installs the wrapper if needed)."""
    global _listeners, _original
    if _original is None:  # the function torch shipped, taken once
        _original = torch.autograd.backward
    if torch.autograd.backward is not _backward:
        torch.autograd.backward = _backward
    _listeners = (*_listeners, listener)


def unlisten(listener: Listener) -> None:
    """Stop telling ``listener``; the last one out puts ``torch.autograd.backward`` back."""
    global _listeners
    _listeners = tuple(x for x in _listeners if x is not listener)
    if not _listeners and torch.autograd.backward is _backward:
        torch.autograd.backward = _original
