"""``phase-timer run``'s side in the script's process: every Lightning and 🤗 ``Trainer`` it builds gets the callback.

``phase-timer run`` starts the script with a ``sitecustomize`` of its own first on ``PYTHONPATH``
(``phase_timer/cli/boot/``), which Python imports at start-up, before the script; that calls
:func:`install`.  :func:`install` puts an import hook on ``sys.meta_path`` that, once
``lightning.pytorch``'s, ``pytorch_lightning``'s or ``transformers``' trainer module has run, wraps its
``Trainer.__init__``: the call's ``callbacks`` get a :class:`~phase_timer.PhaseTimer` (or a
:class:`~phase_timer.PhaseTimerCallback`) with the options given to ``phase-timer run``, unless they hold one
already.  Nothing is imported that the script does not import itself.

The environment: a launcher (``torchrun``, ``python -m torch.distributed.run``, ``accelerate launch``) keeps
``phase-timer run``'s variables, so that the training processes it starts get the hook.  Any other process
takes them out of ``os.environ`` at once, so that what it starts (a ``git`` call, a tokenizer's helper, a
DataLoader worker that is a new interpreter) runs without phase-timer, and puts them back when it builds its
first Trainer: a training process's own children (Lightning's DDP launcher runs the script again) are
training processes too.

A hand-written loop (no Trainer) is timed from its third step by :mod:`phase_timer.doors.autoloop`, once
``torch.optim``'s optimizer module has run: its optimizers are the ones that step in an iteration, its models
the modules in reach that hold their parameters; where that cannot be known, it says why at the end.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
from typing import Any, Callable

#: The options (JSON: the doors' argument names), the marker directory and the boot directory on PYTHONPATH.
ENV_OPTIONS = "PHASE_TIMER_RUN_OPTIONS"
ENV_REPORT = "PHASE_TIMER_RUN_REPORT"
ENV_BOOT = "PHASE_TIMER_RUN_BOOT"
ENV_ROOT = "PHASE_TIMER_RUN_ROOT"
_VARS = (ENV_OPTIONS, ENV_REPORT, ENV_BOOT, ENV_ROOT)
#: The trainer modules, and which door each gets.
TRAINER_MODULES = {"lightning.pytorch.trainer.trainer": "lightning", "pytorch_lightning.trainer.trainer": "lightning",
                   "transformers.trainer": "transformers"}
#: The module whose global step hooks watch a hand-written loop (:mod:`phase_timer.doors.autoloop`).
OPTIMIZER_MODULE = "torch.optim.optimizer"
_saved: dict[str, str] = {}
#: The hand-written loop's watch, and the timer it attached (kept for the process's life).
_loop_watch: Any = None
_loop_timer: Any = None


def is_launcher(argv: list[str]) -> bool:
    """Whether ``argv`` (``sys.orig_argv``) starts training processes rather than being one."""
    words = [os.path.basename(a) for a in argv[1:4]]
    if words and words[0] in ("torchrun", "accelerate"):
        return True
    if len(argv) > 2 and argv[1] == "-m":
        return argv[2] in ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")
    return False


def strip_env() -> None:
    """phase-timer run's variables out of ``os.environ`` (kept, for :func:`restore_env`)."""
    boot = os.environ.get(ENV_BOOT)
    for name in _VARS:
        if name in os.environ:
            _saved[name] = os.environ.pop(name)
    path = os.environ.get("PYTHONPATH")
    if boot and path is not None:
        _saved["PYTHONPATH"] = path
        rest = [p for p in path.split(os.pathsep) if p != boot]
        if rest:
            os.environ["PYTHONPATH"] = os.pathsep.join(rest)
        else:
            del os.environ["PYTHONPATH"]


def restore_env() -> None:
    os.environ.update(_saved)


def options() -> dict[str, Any]:
    raw = _saved.get(ENV_OPTIONS, os.environ.get(ENV_OPTIONS, "{}"))
    return json.loads(raw)


def _has(callbacks: Any, cls: type) -> bool:
    return any(isinstance(c, cls) for c in callbacks or ())


def make_callback(door: str) -> tuple[type, Any]:
    """The callback class of ``door`` and one made with the options (``window``: the door's own name for it)."""
    opts = dict(options())
    if door == "lightning":
        from phase_timer.doors.lightning import PhaseTimer as cls

        if "window" in opts:
            opts["log_every_n_steps"] = opts.pop("window")
    else:
        from phase_timer.doors.hf_trainer import PhaseTimerCallback as cls
    if isinstance(opts.get("trace_steps"), list):
        opts["trace_steps"] = tuple(opts["trace_steps"])
    return cls, cls(**opts)


def _mark(door: str, added: bool, note: str | None = None) -> None:
    """A line for ``phase-timer run``: this process built a Trainer, or found a loop (and whether it got the
    callback or the timer here; ``note``: what was timed, or why not)."""
    where = _saved.get(ENV_REPORT) or os.environ.get(ENV_REPORT)
    if not where:
        return
    try:
        with open(os.path.join(where, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"door": door, "added": added, **({"note": note} if note else {})}) + "\n")
    except OSError:
        pass


def _attach_loop(models: list[Any], opts: list[Any]) -> None:
    """The hand-written loop's timer, with the run's options (the plain door's names)."""
    from phase_timer.doors.autoloop import names
    from phase_timer.doors.loop import attach

    global _loop_timer
    restore_env()  # a training process: what it starts may train too
    timer = _loop_timer = attach(models[0] if len(models) == 1 else models, opts[0] if len(opts) == 1 else opts,
                                 **options())
    atexit.register(timer.close)  # the script has no close of its own; before the never-closed handler (LIFO)
    _mark("loop", True, names(models, opts))


def _loop_untimed(why: str) -> None:
    _mark("loop", False, why)


def _is_timed() -> bool:
    from phase_timer.doors import lifecycle

    return bool(lifecycle._open)


def watch_loop(_module: Any = None) -> None:
    """The hand-written loop's watch, once ``torch.optim``'s optimizer module has run (once per process)."""
    global _loop_watch
    if _loop_watch is not None:
        return
    try:
        from phase_timer.doors.autoloop import LoopWatch

        _loop_watch = LoopWatch(_attach_loop, _loop_untimed, _is_timed)
    except Exception as err:  # noqa: BLE001 - the script runs untimed rather than not at all
        _loop_untimed(f"the loop's watch failed ({type(err).__name__}: {err})")


def _stop_loop_watch() -> None:
    if _loop_watch is not None and not _loop_watch.done:
        _loop_watch.remove()


def wrap_init(cls: type, door: str) -> None:
    """``cls.__init__`` with the callback added to its ``callbacks`` argument."""
    init = cls.__init__
    if getattr(init, "_phase_timer_run", False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind_partial(self, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        callbacks = [callbacks] if callbacks is not None and not isinstance(callbacks, (list, tuple)) else callbacks
        timer_cls, timer = make_callback(door)
        added = not _has(callbacks, timer_cls)
        if added:
            bound.arguments["callbacks"] = [*(callbacks or ()), timer]
        restore_env()  # a training process: what it starts may train too
        _stop_loop_watch()  # the Trainer's door times it, not the loop's
        _mark(door, added)
        init(*bound.args, **bound.kwargs)

    __init__._phase_timer_run = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def _wrap_trainer(door: str) -> Callable[[Any], None]:
    def after(module: Any) -> None:
        if isinstance(getattr(module, "Trainer", None), type):
            wrap_init(module.Trainer, door)

    return after


#: What runs once each watched module has run: the trainer modules' ``Trainer`` wrapped; the loop's watch.
AFTER: dict[str, Callable[[Any], None]] = {**{name: _wrap_trainer(door) for name, door in TRAINER_MODULES.items()},
                                           OPTIMIZER_MODULE: watch_loop}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, after: Callable[[Any], None]) -> None:
        self.inner, self.after = inner, after

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.after(module)


class TrainerFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the watched modules' specs back with a loader that runs their :data:`AFTER`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        after = AFTER.get(name)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


def install() -> None:
    """At start-up (``sitecustomize``): the hook, or for a launcher nothing (its workers get the hook)."""
    if is_launcher(list(getattr(sys, "orig_argv", sys.argv))):
        return
    strip_env()
    for name, after in AFTER.items():  # imported already (a sitecustomize before ours): now
        module = sys.modules.get(name)
        if module is not None:
            after(module)
    sys.meta_path.insert(0, TrainerFinder())
