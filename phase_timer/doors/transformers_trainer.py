"""What the 🤗 callback reads of a transformers Trainer, and the guard it puts around the Trainer's training loop.

Callbacks are not handed the Trainer: the callback finds it in the frames that called it
(:func:`calling_trainer`).  Of it, the callback reads the TensorBoard writer the Trainer made
and its other reporters (``report_to``); on it, from ``on_init_end``, it puts a guard in place of
``_inner_training_loop``, so that whatever raises in the loop closes the timer first.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any

from phase_timer._env import warn
from phase_timer.outputs.user_sinks import trainer_reporters

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger(__name__)


def guard_loop(callback: Any, trainer: Trainer) -> None:
    """Put :class:`_GuardedLoop` on the Trainer instance in place of its ``_inner_training_loop`` (``train()``
    looks it up at each call): whatever raises in it -- the callbacks' events, clipping, ``floating_point_ops``,
    a KeyboardInterrupt between two of our hooks -- closes the timer (``callback._finish``: written, marked
    interrupted, hooks put back) and goes on unchanged."""
    trainer._inner_training_loop = _GuardedLoop(callback, trainer)


class _GuardedLoop:
    """The Trainer's own ``_inner_training_loop``, guarded.  A plain object, not a closure over the bound method:
    it pickles with the Trainer, and ``del trainer`` frees it without waiting for the cyclic collector."""

    def __init__(self, callback: Any, trainer: Trainer) -> None:
        self._callback = callback
        self._trainer = weakref.ref(trainer)
        # accelerate's find_executable_batch_size reads the signature: the method's own, bound
        self.__signature__ = inspect.signature(trainer._inner_training_loop)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        try:
            return type(trainer)._inner_training_loop(trainer, *args, **kwargs)
        except BaseException as err:
            self._callback._finish(interrupted=True, error=err)
            raise

    def __getstate__(self) -> dict[str, Any]:
        return {"_callback": self._callback, "_trainer": self._trainer(), "__signature__": self.__signature__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _trainer=weakref.ref(state["_trainer"]))


def calling_trainer() -> Trainer | None:
    """The Trainer whose training loop called ``on_train_begin`` (callbacks are not handed it)."""
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def reporters(trainer: Any) -> list[Any]:
    """Sinks into the Trainer's other reporters (``report_to``: W&B, MLflow), at its ``global_step``; a reporter
    that cannot be written warns once and is left out (the run is still timed)."""
    try:
        return trainer_reporters(trainer)
    except Exception as err:  # noqa: BLE001 - an integration's internals changed: time the run all the same
        warn(log, f"phase-timer: the Trainer's reporters cannot be written ({type(err).__name__}: {err}); "
                  "the values go to TensorBoard and the summary file")
        return []


def tensorboard_writer(trainer: Any) -> Any:
    """The SummaryWriter of the Trainer's TensorBoard callback (``report_to`` has tensorboard), if any.

    That callback comes before ours (the Trainer's own callbacks are listed first), so its
    ``on_train_begin`` has made the writer: in ``$TENSORBOARD_LOGGING_DIR`` or
    ``<output_dir>/runs/...``, wherever it decided.
    """
    for cb in getattr(trainer.callback_handler, "callbacks", ()):
        writer = getattr(cb, "tb_writer", None)
        if type(cb).__name__ == "TensorBoardCallback" and writer is not None and hasattr(writer, "log_dir"):
            return writer
    return None
