"""Sinks for where users already look: a ``SummaryWriter``, a W&B run, an MLflow run, any callable.

``attach(..., sinks=[...])`` takes what the user has; :func:`as_sink` turns each into a
:class:`~phase_timer.outputs.sinks.Sink`.  The 🤗 door finds the Trainer's own reporters with
:func:`trainer_reporters`.  What each writes, at which step and on which thread
(``docs/design.md``, "Where values go: sinks"):

==================  ===========================================  =====================
given               written as                                   thread
==================  ===========================================  =====================
SummaryWriter       one event of scalars a write, at the step    phase-timer's own
W&B run             a history row with its x value               the training thread
                    ``phase_timer/step`` (see :class:`WandbSink`)
MLflow run          one ``log_batch`` a write, at the step       phase-timer's own
callable            ``fn(step, values)``, a copy of the values   the training thread
==================  ===========================================  =====================

Neither ``wandb`` nor ``mlflow`` is imported here unless the user's program already has: an
object can only be a W&B run if ``wandb`` is in ``sys.modules``.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from phase_timer._env import warn
from phase_timer.outputs.sinks import Outputs
from phase_timer.config import _fail
from phase_timer.outputs.sinks import BackgroundSink, GuardedSink, Sink, SummaryWriterSink

log = logging.getLogger(__name__)

#: What ``sinks`` takes, as the error says it.
EXPECTED = ("a list of SummaryWriters, W&B runs, MLflow runs (or the `mlflow` module: its active run), "
            "callables of (step, values) or sinks (write/flush/close)")
#: The W&B x value of phase-timer's rows in a user's run: their own steps stay theirs.
WANDB_STEP = "phase_timer/step"
#: Most tags phase-timer writes start with one of these; the others are bound by name (``WandbSink._bind``).
_WANDB_GLOBS = ("phase_time*", "phase_memory*")
_WANDB_PREFIXES = tuple(g.rstrip("*") for g in _WANDB_GLOBS)
#: The 🤗 Trainer's W&B x value (its WandbCallback defines it and logs every row with it).
TRAINER_WANDB_STEP = "train/global_step"
#: MLflow takes at most this many metrics a ``log_batch`` call.
_MLFLOW_BATCH = 1000


# -- what the user passed ------------------------------------------------------------------
def check_sinks(owner: str, sinks: Any) -> tuple[Any, ...]:
    """``sinks`` as given, each of a kind :func:`as_sink` takes (None entries skipped); else a ValueError
    naming ``sinks``.  No side effect: every rank checks, rank zero alone builds them."""
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, (list, tuple)):
        _fail(owner, "sinks", sinks, EXPECTED)
    for i, obj in enumerate(sinks):
        if obj is not None and _kind(obj) is None:
            _fail(owner, "sinks", sinks, EXPECTED, f": sinks[{i}] is a {type(obj).__name__}")
        if _kind(obj) == "callable" and not _takes_step_and_values(obj):
            _fail(owner, "sinks", sinks, EXPECTED, f": sinks[{i}] cannot be called as fn(step, values)")
    return tuple(obj for obj in sinks if obj is not None)


def as_sink(obj: Any, owner: str = "attach") -> Sink:
    """What the user passed, as a sink, on the thread it is safe on (module docstring); a ValueError naming
    ``sinks`` for anything else, or for ``mlflow`` with no active run."""
    kind = _kind(obj)
    if kind == "tensorboard":
        return BackgroundSink(SummaryWriterSink(obj, owned=False), "SummaryWriter")
    if kind == "wandb":
        return GuardedSink(WandbSink(obj), "the W&B run")
    if kind == "wandb module":
        if obj.run is None:
            _fail(owner, "sinks", obj, "a W&B run", ": the `wandb` module has no run (call wandb.init() first)")
        return GuardedSink(WandbSink(obj.run), "the W&B run")
    if kind in ("mlflow", "mlflow module"):
        return BackgroundSink(MlflowSink(_mlflow_run_id(obj, owner), _mlflow_uri()), "the MLflow run")
    if kind == "sink":
        return obj
    if kind == "callable":
        return GuardedSink(CallableSink(obj), getattr(obj, "__qualname__", type(obj).__name__))
    _fail(owner, "sinks", obj, EXPECTED)


def with_user_sinks(outputs: Callable[[bool], Outputs], sinks: Sequence[Any], owner: str) -> Callable[[bool], Outputs]:
    """A door's outputs, and the user's sinks beside them (rank zero: the door calls it there only)."""

    def both(ranks: bool) -> Outputs:
        mine = [as_sink(obj, owner) for obj in sinks]  # a run that is not there fails before any file is made
        try:
            out = outputs(ranks)
        except BaseException:
            for sink in mine:
                sink.close()
            raise
        out.sinks.extend(mine)
        return out

    return both if sinks else outputs


def _kind(obj: Any) -> str | None:
    """Which of the kinds in the module docstring ``obj`` is (None: none)."""
    if _is_a(obj, "wandb.sdk.wandb_run", "Run"):
        return "wandb"
    if obj is sys.modules.get("wandb"):
        return "wandb module"
    if _is_a(obj, "mlflow.entities", "Run"):  # an ActiveRun (mlflow.start_run()) is one too
        return "mlflow"
    if obj is sys.modules.get("mlflow"):
        return "mlflow module"
    if callable(getattr(obj, "add_scalar", None)):
        return "tensorboard"
    if all(callable(getattr(obj, name, None)) for name in ("write", "flush", "close")) and \
            _takes_step_and_values(obj.write):  # not a file: its write takes one argument
        return "sink"
    if callable(obj) and not isinstance(obj, (type, types.ModuleType)):
        return "callable"
    return None


def _is_a(obj: Any, module: str, name: str) -> bool:
    """``isinstance(obj, module.name)``, without importing ``module`` (not imported: obj cannot be one)."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _takes_step_and_values(fn: Any) -> bool:
    try:
        inspect.signature(fn).bind(0, {})
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): it is called, and a failure warns
        return True
    return True


# -- W&B -----------------------------------------------------------------------------------
class WandbSink:
    """Rows in a W&B run's history, each with its x value (``x_axis``): never a ``step=`` of phase-timer's.

    W&B keeps one row per step of its own, and drops what is logged at a step below the run's
    (``step must be monotonically increasing``).  phase-timer's values arrive steps late (they are
    resolved lazily), so they carry their step as a value, ``phase_timer/step``, made their x-axis
    with ``define_metric``; and they take no step of the run's while anyone else logs into it:

    * the run has moved on since our last values (the user logged): ours go into the row it has
      open (``commit=False``), beside the user's, and the user's next log writes that row;
    * it has not (nobody logs between two of our writes): our last values hold the open row, so
      ours open the next one (``step=`` the run's own step + 1, never one of phase-timer's).

    A user's ``run.log({...})`` keeps every value; so does ``run.log({...}, step=i)`` while ours come
    at most once between two of the user's, plus a burst of two (the windows resolved at the end).
    Not kept (W&B warns): ``per_step``, or ``step=`` slower than our windows (``step=epoch``): our rows
    outnumber the user's steps.  ``docs/design.md`` ("Where values go: sinks") has the cases.

    Written on the training thread: whether the open row holds our values depends on what the
    user logged before, in order (from another thread, the user could log between our look and our
    write).  One ``run.step`` and one ``run.log`` a write: ~1.3 ms for a window's values, measured
    offline on a loaded 2-core machine.

    ``own_rows`` (the 🤗 Trainer's run): every write a row of its own, with the Trainer's own x value
    ``train/global_step``: its WandbCallback logs the same way (no ``step=``), so rows never clash.
    """

    def __init__(self, run: Any, *, x_axis: str = WANDB_STEP, own_rows: bool = False) -> None:
        self._run = run
        self._x = x_axis
        self._own_rows = own_rows
        self._filled: int | None = None  # the run's step whose open row holds our last values
        self._bound: set[str] = set()  # tags given our x-axis one by one (the globs' aside)
        self._ended = False  # the user finished the run: nothing more goes to it
        if not own_rows:
            self._define_x_axis()

    def _define_x_axis(self) -> None:
        """``phase_timer/step`` the x-axis of every tag of ours (never the user's), before our first row."""
        try:
            self._run.define_metric(self._x, hidden=True)  # before the globs, which would match it too
            for pattern in _WANDB_GLOBS:
                self._run.define_metric(pattern, step_metric=self._x)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            warn(log, f"phase-timer: could not define {self._x} as the x-axis of its values in the W&B run "
                      f"({type(err).__name__}: {err}); they are written, against W&B's own step", 4)

    def _finished(self) -> bool:
        """The user finished the run (``run.finish()`` before phase-timer's close): W&B's own flag, read without a
        call (on a finished run ``run.step`` blocks, 30 s in wandb 0.31, and ``run.log`` raises).  Said once."""
        if not self._ended and getattr(self._run, "_is_finished", False):
            self._ended = True
            warn(log, "phase-timer: the W&B run was finished before phase-timer closed (run.finish() inside the "
                      "timer's block or before the Trainer's end): the values from here on (the last windows, the "
                      "verdict) are in the event file and the summary file, not in W&B", 4)
        return self._ended

    def _bind(self, scalars: dict[str, float]) -> None:
        """Every tag of ours against our x-axis, before its first row: the globs cover ``phase_time*`` and
        ``phase_memory*``; any other (``throughput/*``, ``comm/*``, ``phase_timer/*``) is bound by its own name,
        never by a glob that could take a user's tag of the same prefix."""
        new = [t for t in scalars if t not in self._bound and not t.startswith(_WANDB_PREFIXES)]
        for tag in new:
            try:
                self._run.define_metric(tag, step_metric=self._x)
            except Exception as err:  # noqa: BLE001 - the timer must never break training
                warn(log, f"phase-timer: could not define {self._x} as the x-axis of {tag} in the W&B run "
                          f"({type(err).__name__}: {err}); it is written against W&B's own step", 4)
            self._bound.add(tag)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self._finished():
            return
        row = {**scalars, self._x: step}
        if self._own_rows:
            self._run.log(row)
            return
        self._bind(scalars)
        now = self._run.step  # the step of the run's open row
        if now == self._filled:  # nobody has logged since our last values: they keep that row
            self._run.log(row, step=now + 1, commit=False)
            self._filled = now + 1
        else:
            self._run.log(row, commit=False)
            self._filled = now

    def write_text(self, tag: str, text: str, step: int) -> None:
        """The verdict, in the run's summary (its overview page), not in its history."""
        if not self._finished():
            self._run.summary[tag] = text

    def flush(self) -> None:
        """Nothing: the run's open row is written by the user's next log or ``run.finish()``."""

    def close(self) -> None:
        """The run is the user's: left open, our last values in its open row."""


# -- MLflow --------------------------------------------------------------------------------
def _mlflow_run_id(obj: Any, owner: str) -> str:
    """The run ``obj`` is, or for the ``mlflow`` module the active run of this thread (the fluent API keeps
    it per thread, so it is read here, not on the writer's thread)."""
    run = obj.active_run() if obj is sys.modules.get("mlflow") else obj
    if run is None:
        _fail(owner, "sinks", obj, "an MLflow run", ": the `mlflow` module has no active run (call "
              "mlflow.start_run() first, or pass the run it returns)")
    return run.info.run_id


def _mlflow_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


class MlflowSink:
    """A run's metrics through ``MlflowClient.log_batch``: one call a write, at the step; MLflow takes steps
    in any order.  Safe off the training thread (a client of its own, the run by id)."""

    def __init__(self, run_id: str, tracking_uri: str) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        self._client = MlflowClient(tracking_uri)
        self._metric = Metric
        self.run_id = run_id

    def write(self, step: int, scalars: dict[str, float]) -> None:
        ms = int(time.time() * 1000)
        metrics = [self._metric(tag, float(value), ms, step) for tag, value in scalars.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MLFLOW_BATCH])

    def write_text(self, tag: str, text: str, step: int) -> None:
        """The verdict as a text artifact of the run (``phase_timer/diagnosis.md``)."""
        self._client.log_text(self.run_id, text, f"{tag}.md")

    def flush(self) -> None:
        """Nothing: every ``log_batch`` is written when it returns."""

    def close(self) -> None:
        """The run is the user's (or the Trainer's): left open."""


# -- any callable --------------------------------------------------------------------------
class CallableSink:
    """``fn(step, values)``, each write, in step order, on the training thread: a callable may be anything
    (a logger that is not thread-safe), and one that is slow can hand off itself.  ``values`` is a copy."""

    def __init__(self, fn: Callable[[int, dict[str, float]], Any]) -> None:
        self._fn = fn

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._fn(step, dict(scalars))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- the 🤗 door ---------------------------------------------------------------------------
def trainer_reporters(trainer: Any) -> list[Sink]:
    """Sinks into the Trainer's own reporting runs (``report_to``): W&B and MLflow, at the step written.

    The door's core adds its ``log_step_offset``, so the step is the Trainer's ``global_step``.
    Call it from ``on_train_begin`` of a callback after the Trainer's own: their ``on_train_begin``
    has made the runs by then.  TensorBoard is the door's own (``_tensorboard_writer``).
    """
    from transformers.integrations import MLflowCallback, WandbCallback

    out: list[Sink] = []
    for cb in getattr(trainer.callback_handler, "callbacks", ()):
        if isinstance(cb, WandbCallback):
            run = getattr(cb._wandb, "run", None) if cb._wandb is not None else None
            if run is not None:  # None: not set up, or not the main process
                out.append(BackgroundSink(WandbSink(run, x_axis=TRAINER_WANDB_STEP, own_rows=True), "the W&B run"))
        elif isinstance(cb, MLflowCallback) and cb._initialized:
            run = cb._ml_flow.active_run()  # this thread's: the Trainer's callbacks run here
            if run is not None:
                sink = MlflowSink(run.info.run_id, cb._ml_flow.get_tracking_uri())
                out.append(BackgroundSink(sink, "the MLflow run"))
    return out
