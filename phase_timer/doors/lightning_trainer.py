"""What the Lightning callback reads of Lightning (its namespaces; a Trainer's loggers, counts and loader), and
the internals of a Trainer it wraps where Lightning has no hook for a boundary.

Lightning comes as ``lightning.pytorch`` or ``pytorch_lightning``; a program may import either,
or both.  Nothing here imports one the program has not (importing one rebinds the rank-zero
logger the two share), and everything read of a Trainer is read of its own namespace.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phase_timer.doors.assemble import own_event_file, writer_sink
from phase_timer.outputs.sinks import Outputs
from phase_timer.runinfo import loader_info
from phase_timer.outputs.sinks import GuardedSink

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from phase_timer.doors.options import Options

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def namespaces_in_use() -> list[Any]:
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


def timer_class(cls: type) -> type:
    """``cls`` (PhaseTimer, or a user's subclass) with the Callback of every Lightning namespace in use as
    bases too; ``cls`` itself when it already has them."""
    bases = tuple(dict.fromkeys(m.Callback for m in namespaces_in_use()))
    if all(issubclass(cls, b) for b in bases):
        return cls
    made = _CLASSES.get((cls, *bases))
    if made is None:
        made = type(cls.__name__, (cls, *bases), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                                   "_timer_base": cls})
        _CLASSES[(cls, *bases)] = made
    return made


def remade(cls: type, state: dict[str, Any]) -> Any:
    """Unpickling: the instance again, of the class made for ``cls`` in this process."""
    obj = object.__new__(timer_class(cls))
    obj.__dict__.update(state)
    return obj


def _training_stage(trainer: pl.Trainer) -> Any:
    """``RunningStage.TRAINING`` of the namespace the Trainer comes from (``lightning.pytorch`` or
    ``pytorch_lightning``), for an identity test first (``trainer.training`` compares enums by value)."""
    module = type(trainer).__module__
    package = module[: module.index(".trainer")] if ".trainer" in module else "lightning.pytorch"
    try:
        return importlib.import_module(f"{package}.trainer.states").RunningStage.TRAINING
    except (ImportError, AttributeError):
        return "train"  # the enum's value: `!=` still compares right


def steps_count(trainer: pl.Trainer, manual: bool) -> Any:
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


def train_loader_info(trainer: pl.Trainer) -> dict[str, Any] | None:
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


# -- Lightning's internals, wrapped ------------------------------------------------------------
def wrap_internals(timer: Any, trainer: pl.Trainer) -> None:
    """Where Lightning has no hook for a boundary, wrap what it calls for ``timer`` (the PhaseTimer; on the
    instance, and the timer's ``_restore`` puts it back): the transfer (``batch``, ``copied``), the epoch loop's
    fetch hooks (``fetch``, ``data_wait``) and its SIGTERM broadcast (``sync_wait``)."""
    original = trainer.strategy.batch_to_device
    training = _training_stage(trainer)

    def batch_to_device(batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        bounds = timer._bounds
        stage = trainer.state.stage  # `trainer.training`, without its property and the enum's __eq__ each batch
        if bounds is None or (stage is not training and stage != training):
            return original(batch, device, dataloader_idx)
        timer._on_batch(trainer, bounds)
        bounds.count_batch(batch)  # the step's samples/tokens and FLOPs, from shapes
        out = original(batch, device, dataloader_idx)
        bounds.on_copied()
        return out

    timer._patch(trainer.strategy, "batch_to_device", batch_to_device)
    epoch_loop = trainer.fit_loop.epoch_loop
    # The training epoch loop hands these two to its data fetcher, which calls them
    # around each `next()` of the loader: the fetch boundary and `data_wait`.
    before, after = getattr(epoch_loop, "_on_before_fetch", None), getattr(epoch_loop, "_on_after_fetch", None)
    timer._fetch_hooked = callable(before) and callable(after)
    if timer._fetch_hooked:

        def on_before_fetch() -> None:
            if timer._bounds is not None and not timer._iter_mode:
                timer._bounds.on_fetch()
            timer._fetch_t0 = time.perf_counter_ns()
            before()

        def on_after_fetch() -> None:
            after()
            now = time.perf_counter_ns()
            if timer._iter_mode:  # inside the step: its data_wait, now
                if timer._bounds is not None:
                    timer._bounds.core.add_host("data_wait", (now - timer._fetch_t0) / 1e6)
                return
            timer._fetch_end = now
            timer._fetch_ns += now - timer._fetch_t0

        timer._patch(epoch_loop, "_on_before_fetch", on_before_fetch)
        timer._patch(epoch_loop, "_on_after_fetch", on_after_fetch)
    # Lightning 2.6 broadcasts a SIGTERM flag before every batch when distributed and
    # reads it back with `.item()`: the host waits there for the device and the other
    # ranks.  That wait is timed as `sync_wait`, outside the step and its data_wait.
    broadcast = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
    if callable(broadcast):

        def timed_broadcast(*args: Any, **kwargs: Any) -> Any:
            if timer._bounds is not None:
                timer._bounds.fetch()  # the time between steps ends where the next batch's preparation begins
            t0 = time.perf_counter_ns()
            try:
                return broadcast(*args, **kwargs)
            finally:
                timer._sync_wait_ns += time.perf_counter_ns() - t0

        timer._patch(epoch_loop, "_broadcast_sigterm_tensor", timed_broadcast)


def let_go_of_module(timer: Any) -> None:
    """The fit's end: Lightning binds every callback's ``log`` and ``log_dict`` to the module's at each fit; kept past
    it, they would keep the model, its gradients and its optimizer's state alive as long as the timer (a sweep keeps
    one a run)."""
    for name in ("log", "log_dict"):
        if getattr(timer.__dict__.get(name), "__self__", timer) is not timer:
            del timer.__dict__[name]


# -- where the values go -----------------------------------------------------------------
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


def trainer_outputs(trainer: pl.Trainer, config: Options) -> Callable[[bool], Outputs]:
    """Every logger of the trainer (a TensorBoardLogger's writer straight, on a thread of its own), or
    without one, an event file of our own in ``log_dir``: a failure there warns and the run goes on."""

    def outputs(ranks: bool) -> Outputs:
        out = Outputs()
        tensorboard = _tensorboard_loggers(trainer)
        loggers = _loggers(trainer)
        for lg in loggers:
            if tensorboard and isinstance(lg, tensorboard):
                out.sinks.append(writer_sink(lg.experiment, config, ranks=ranks, name=type(lg).__name__))
                out.log_dir = lg.log_dir
            else:
                out.sinks.append(GuardedSink(_LoggerSink(lg), type(lg).__name__))
        if not out.sinks and config.log_dir is not None:
            return own_event_file(os.fspath(config.log_dir), config=config, ranks=ranks, fail_fast=False)
        out.summary_dir = out.log_dir or _first_log_dir(loggers)
        return out

    return outputs


def _tensorboard_loggers(trainer: Any) -> tuple[type, ...]:
    """TensorBoardLogger of the trainer's own namespace (the one it was built from)."""
    ns = type(trainer).__module__.split(".trainer")[0]
    try:
        cls = getattr(importlib.import_module(f"{ns}.loggers"), "TensorBoardLogger", None)
    except ImportError:
        return ()
    return (cls,) if cls is not None else ()


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
