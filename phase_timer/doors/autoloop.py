"""``phase-timer run`` on a hand-written loop: :func:`~phase_timer.attach` made from what the loop itself shows.

A loop that builds no Trainer names its optimizers only by stepping them, and its model only by holding it.
So the process watches the optimizers' steps (two global step hooks, ``torch.optim``'s own, a call each at
an optimizer's step and nothing anywhere else) for one whole iteration:

- the first optimizer to step starts the count; every other one that steps before it steps again belongs to
  the iteration, in the order they step (the step ends after the last one's ``step()``, as ``attach``'s does);
- at the end of the second iteration (after its last optimizer's step), the models are the modules the loop can
  reach (the locals of every frame from the loop's down to the step, and its module's globals, one attribute
  level deep into an object such as ``self``) that hold the optimizers' parameters, the outermost of them (a
  ``DistributedDataParallel`` or a compiled module before the module it wraps);
- it attaches there, with ``phase-timer run``'s options: timing begins at the third step, and the hooks that
  watched are taken off.

Nothing is guessed: where no module in reach holds the parameters, where a timer is open already (the
script's own ``attach`` or a Trainer's callback), or where the optimizers never step twice, nothing is
attached, and the reason reaches ``phase-timer run``'s last line.  Steps are found by the models' forwards
(``attach`` with no loader: the loop makes its own batches, as nanoGPT's does), so ``data_wait`` is the time
between a step's end and the next forward.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

#: The iterations watched before attaching: the first's optimizers are counted by the second.
WATCHED = 2


def _param_ids(opts: list[Any]) -> set[int]:
    return {id(p) for opt in opts for group in opt.param_groups for p in group["params"]}


def _reachable(frame: types.FrameType | None) -> list[Any]:
    """The modules the loop can reach from ``frame`` up: each frame's locals, the outermost's globals, and one
    attribute level into the objects they hold (``self.model``), lists, tuples and dicts of modules too."""
    from torch import nn

    found: dict[int, Any] = {}

    def take(value: Any, depth: int) -> None:
        if isinstance(value, nn.Module):
            found.setdefault(id(value), value)
            return
        if not depth or isinstance(value, (type, types.ModuleType, types.FunctionType)):
            return
        if isinstance(value, (list, tuple)):
            inner = value
        else:
            held = value if isinstance(value, dict) else getattr(value, "__dict__", None)
            inner = list(held.values()) if isinstance(held, dict) else []
        for v in inner[:64]:
            take(v, 0)

    last = None
    while frame is not None:
        for value in list(frame.f_locals.values()):
            take(value, 1)
        last, frame = frame, frame.f_back
    if last is not None:
        for value in list(last.f_globals.values()):
            take(value, 1)
    return list(found.values())


def find_models(opts: list[Any], frame: types.FrameType | None) -> list[Any]:
    """The outermost modules in reach of ``frame`` that hold any of ``opts``' parameters (in the order found)."""
    wanted = _param_ids(opts)
    held = [(m, {id(p) for p in m.parameters()}) for m in _reachable(frame)]
    held = [(m, ids) for m, ids in held if ids & wanted]
    outer = []
    for m, ids in held:
        inside = False
        for other, other_ids in held:
            if other is m or not ids <= other_ids:
                continue
            # a module inside another (its parameters among the other's): the other is the one called, unless
            # the two hold the same parameters and this one wraps the other
            if ids < other_ids or any(sub is m for sub in other.modules()):
                inside = True
                break
        if not inside:
            outer.append(m)
    return outer


class LoopWatch:
    """The two global optimizer hooks that find a hand-written loop's optimizers and models, then attach."""

    def __init__(self, attach: Callable[[list[Any], list[Any]], None], said: Callable[[str], None],
                 is_timed: Callable[[], bool]) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._attach, self._said, self._is_timed = attach, said, is_timed
        self.first: Any = None
        self.seen = 0  # the first optimizer's steps begun
        self.order: list[Any] = []  # the iteration's optimizers, in the order they step
        self.last: Any = None  # the iteration's last optimizer, once known
        self.done = False
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]

    def _pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.first is None:
            self.first, self.seen, self.order = opt, 1, [opt]
        elif opt is self.first:
            self.seen += 1
            if self.seen == WATCHED:
                self.last = self.order[-1]
        elif self.seen == 1 and all(o is not opt for o in self.order):
            self.order.append(opt)

    def _post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.done or self.last is None or opt is not self.last:
            return
        self.remove(stepping=True)
        try:
            if self._is_timed():
                self._said("a timer was open already (the script's own attach(), or a Trainer's callback)")
                return
            models = find_models(self.order, sys._getframe(1))
            if not models:
                self._said("no module the loop holds has the optimizer's parameters: use attach() in the script")
                return
            self._attach(models, list(self.order))
        except Exception as err:  # noqa: BLE001 - the script's training goes on untimed
            self._said(f"attaching failed ({type(err).__name__}: {err})")

    def remove(self, stepping: bool = False) -> None:
        """The hooks off.  ``stepping``: from the post-hook, while torch goes through the global post-hooks, where
        taking an entry out fails the iteration unless it is the last: then the post-hook stays, a no-op (done)."""
        self.done = True
        pre, post = self._handles
        pre.remove()
        hooks = post.hooks_dict_ref()
        if not stepping or hooks is None or next(reversed(hooks), None) == post.id:
            post.remove()


def names(models: list[Any], opts: list[Any]) -> str:
    """``GPT, AdamW``: what was attached, for the run's line."""
    return f"{', '.join(type(m).__name__ for m in models)} with {', '.join(type(o).__name__ for o in opts)}"
