"""The 🤗 door: ``transformers.Trainer(callbacks=[PhaseTimerCallback()])``.

An adapter over the plain door (:class:`~phase_timer.doors.loop.LoopTimer`): the phases mean what
:mod:`phase_timer.run.boundaries` says, and this module only tells the boundaries what the
Trainer does.  Callback events alone cannot: forward and backward have none, and the
step's batches are fetched before ``on_step_begin``.  So, for one ``train()`` call, at
``on_train_begin`` the timer attaches to what the Trainer prepared and wraps five of the
Trainer instance's own methods (put back at ``on_train_end``):

=======================  ==============================================================
boundary                 where it is heard
=======================  ==============================================================
fetch -> batches         ``get_batch_samples``: the step's micro-batches, all fetched
                         before the first forward (accelerate's loader reads one batch
                         ahead and copies it to the device inside ``next()``, so the copy
                         is in ``data_wait``; ``h2d`` is absent)
micro-batch              ``training_step`` entry: the 2nd..kth micro-batch of a step
                         (what ran since the last backward is ``idle``)
forward                  from the batches in hand (``on_step_begin`` callbacks,
                         ``_prepare_inputs``, ``compute_loss`` and the model) to the
                         ``backward()`` call
backward                 ``accelerator.backward`` -> ``torch.autograd.backward`` (the plain
                         door's wrapper)
optimizer / step end     clipping, ``on_pre_optimizer_step``; the real optimizer's step
                         hooks (under the ``AcceleratedOptimizer``), or its GradScaler's
                         ``update()`` under fp16 (a skipped step ends there too)
between_steps            the scheduler, ``zero_grad``, ``on_step_end`` callbacks, logging
paused (no phase)        ``_evaluate`` and ``_save_checkpoint`` (wrapped), the epoch's end
=======================  ==============================================================

The Trainer is found from the callback: the frame that called ``on_train_begin`` is the
Trainer's training loop (callbacks are not handed the Trainer itself).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phase_timer._env import warn
from phase_timer.config import DEFAULT_LOG_DIR, disabled_by_env, reject_unknown
from phase_timer.doors.door import ThroughTimer, documented
from phase_timer.doors.loop import LoopTimer
from phase_timer.doors.options import Options
from phase_timer.patches import Patches
from phase_timer.phases import FORWARD
from phase_timer.runinfo import loader_info
from phase_timer.doors.transformers_trainer import calling_trainer, guard_loop, reporters, tensorboard_writer

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "phase_timer.PhaseTimerCallback needs 🤗 transformers, which is not installed: "
        "pip install 'phase-timer[transformers]'"
    ) from err

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger(__name__)

#: Where values go without a TensorBoard writer of the Trainer's: ``<output_dir>/<this>/version_N``.
DEFAULT_DIR = DEFAULT_LOG_DIR
#: The Trainer's methods wrapped on the instance for one ``train()`` call.
_WRAPPED = ("get_batch_samples", "training_step", "_evaluate", "_save_checkpoint", "_finalize_training")


@documented(run="each ``train()``", end="the end of ``train()``")
class PhaseTimerCallback(ThroughTimer, TrainerCallback):
    """Times every optimizer step of ``Trainer.train()``: the same phases as the other two doors.

    Values go to the Trainer's TensorBoard run (``report_to`` with ``"tensorboard"``) at its
    ``global_step``, else to ``<output_dir>/phase-timer-logs/version_N``; the summary table is
    printed at the end of ``train()`` on the main process, with the verdict.  A step's batches,
    for ``samples_per_batch``, ``tokens_per_batch`` and the FLOP count, are all its micro-batches
    (tokens: their ``input_ids``, padding included).

    Passed in ``Trainer(callbacks=[...])``, it also guards the Trainer's whole training loop: an
    exception or Ctrl+C anywhere in it (a callback, clipping, logging) writes what was measured,
    marked interrupted, puts every wrapped method back, and goes on to the caller unchanged.

    Args:
        log_dir: write to this directory instead (``version_N`` inside it).
        window: steps per logging window (default: the Trainer's ``logging_steps``).
        {options}

    Attributes (the last ``train()``'s; ``None`` before its end):
        timer: the :class:`~phase_timer.LoopTimer` of the last ``train()`` call.
        {results}
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        window: int | None = None,
        warmup_steps: int = 5,
        max_pending: int = 64,
        per_step: bool = False,
        summary: bool = True,
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
        reject_unknown("PhaseTimerCallback", PhaseTimerCallback.__init__, unknown)
        self.config = Options.of("PhaseTimerCallback", locals())
        self.enabled = enabled
        self.timer: LoopTimer | None = None
        self._trainer: Trainer | None = None
        self._first_micro = False
        self._state: TrainerState | None = None
        self._patches = Patches()

    # -- train() begins and ends --------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The Trainer is built: guard its whole training loop (nothing measured is lost, whatever raises)."""
        trainer = calling_trainer()
        if trainer is not None and "_inner_training_loop" not in trainer.__dict__:
            guard_loop(self, trainer)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, optimizer: Any = None, train_dataloader: Any = None, **kw: Any) -> None:
        self._restore()  # a train() that raised left its wrappers: gone before this one
        if not self.enabled or disabled_by_env():
            return
        trainer = calling_trainer()
        if trainer is None or optimizer is None:
            warn(log, "phase-timer: PhaseTimerCallback could not find the Trainer or its optimizer at on_train_begin "
                      "(a Trainer that calls its callbacks differently?): this train() is not timed")
            return
        try:
            self._attach(trainer, args, state, model, optimizer, train_dataloader)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            warn(log, f"phase-timer: PhaseTimerCallback could not attach to this Trainer ({type(err).__name__}: {err}): "
                      "this train() is not timed")
            self._finish(interrupted=True)
            self.timer = None

    def _attach(self, trainer: Trainer, args: TrainingArguments, state: TrainerState, model: Any, optimizer: Any,
                train_dataloader: Any) -> None:
        self._trainer, self._state = trainer, state
        config = self.config
        writer = tensorboard_writer(trainer)
        if writer is None and config.log_dir is None:
            config = dataclasses.replace(config, log_dir=os.path.join(args.output_dir, DEFAULT_DIR))
        if config.window is None:
            steps = args.logging_steps
            config = dataclasses.replace(config, window=int(steps) if steps >= 1 else 50)
        # The compiled / DDP module the loop calls (never `or`: a compiled module's truth is its len(), which raises).
        module = getattr(trainer, "model_wrapped", None)
        if module is None:
            module = model
        self.timer = timer = LoopTimer(
            module, optimizer, None, config=config, device=None, copy_to_device=False, writer=writer,
            end_step="optimizer", scaler=getattr(optimizer, "scaler", None),
            sinks=reporters(trainer),  # report_to's W&B and MLflow runs, beside TensorBoard
        )
        timer._loader_active = True  # the batches come through get_batch_samples, wrapped below
        if timer.core is not None:
            timer.core.context.update(door="transformers", loader=loader_info(train_dataloader))
            # Steps are numbered by global_step before they run (windows of logging_steps line up with
            # the Trainer's); each is logged where the Trainer logs it, at global_step after it.
            timer.core.log_step_offset = 1
        # An instance attribute of the user's own with one of these names (a patched training_step) is wrapped, and
        # put back.
        for name in _WRAPPED:
            self._patches.replace(trainer, name, getattr(self, f"_{name.lstrip('_')}")(getattr(trainer, name)))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        bounds = self._bounds
        if bounds is not None:
            bounds.epoch_end()  # the epoch's end and what follows until the next fetch: paused

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._finish(interrupted=False)

    # -- the wrapped methods -------------------------------------------------------------
    @property
    def _bounds(self) -> Any:
        timer = self.timer
        return timer._bounds if timer is not None else None

    def _get_batch_samples(self, original: Any) -> Any:
        def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            timer = self.timer
            if timer is None:
                return original(*args, **kwargs)
            t0 = time.perf_counter_ns()
            timer._fetch()
            out = self._guarded(original, args, kwargs)
            bounds = timer._bounds
            if bounds is not None and out[0]:  # no batch left: nothing begins
                state = self._state
                bounds.batch(state.global_step if state is not None else None,
                             (time.perf_counter_ns() - t0) / 1e6, first=FORWARD)
                self._first_micro = True
                for batch in out[0]:  # the step's micro-batches: its samples/tokens; all of them: its FLOPs
                    bounds.count_batch(batch, out[0])
            return out

        return get_batch_samples

    def _training_step(self, original: Any) -> Any:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            bounds = self._bounds
            if bounds is not None:
                if self._first_micro:
                    self._first_micro = False
                else:  # the step's next micro-batch, already fetched: since the last backward, idle
                    bounds.fetch()
                    bounds.batch(first=FORWARD)
            return self._guarded(original, args, kwargs)

        return training_step

    def _finalize_training(self, original: Any) -> Any:
        """The loop is over: close before the Trainer's callbacks end (its TensorBoard callback closes its
        writer in ``on_train_end``, before ours would run)."""

        def finalize_training(*args: Any, **kwargs: Any) -> Any:
            self._finish(interrupted=False)
            return original(*args, **kwargs)

        return finalize_training

    def _evaluate(self, original: Any) -> Any:
        return self._paused(original)

    def _save_checkpoint(self, original: Any) -> Any:
        return self._paused(original)

    def _paused(self, original: Any) -> Any:
        """Evaluation and checkpoints inside ``train()``: in no phase and not in ``period``."""

        def paused(*args: Any, **kwargs: Any) -> Any:
            bounds = self._bounds
            if bounds is None:
                return original(*args, **kwargs)
            was_paused = bounds.paused
            bounds.pause()
            try:
                return self._guarded(original, args, kwargs)
            finally:
                if not was_paused and self._bounds is not None:
                    self._bounds.resume()

        return paused

    def _guarded(self, original: Any, args: Any, kwargs: Any) -> Any:
        """Run the Trainer's own method; if training fails there, close the timer (nothing lost) and re-raise."""
        try:
            return original(*args, **kwargs)
        except BaseException as err:
            self._finish(interrupted=True, error=err)
            raise

    # -- the end ------------------------------------------------------------------------
    def _finish(self, *, interrupted: bool, error: BaseException | None = None) -> None:
        """Put the Trainer back and close the timer (idempotent); ``self.timer`` stays for the user.  ``error``: what
        ended training (an out-of-memory error is explained: ``LoopTimer._caught``)."""
        self._restore()
        if self.timer is None:
            return
        if error is not None:
            self.timer._caught(error)
        try:
            self.timer.close(interrupted=interrupted)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            warn(log, f"phase-timer: closing the timer failed ({type(err).__name__}: {err})")

    def _restore(self) -> None:
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        self._patches.put_back()  # the class's own methods again, or what the user had put on the instance

