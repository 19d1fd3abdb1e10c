"""Optimizer step hooks that see one step per outer ``optimizer.step()`` call.

PyTorch wraps ``step`` of every optimizer class it has hooked, so when a subclass's
``step`` calls ``super().step()`` and the base class was hooked too (any instance of
it existed), the pre/post hooks fire at both levels.  Counting the depth per
optimizer keeps the inner pair from ending the phase early.

An optimizer that wraps another one as ``base_optimizer`` (SAM and its kin) is
hooked through both, sharing one depth: ``sam.step(closure)`` is one step, and so is
``sam.second_step()``, which steps only the base optimizer.

A step given a closure (``opt.step(closure)``) begins its optimizer phase when the closure's first call returns:
the forward and backward the closure runs are the step's own (Lightning's manual optimization, LBFGS).

A wrapper that never ran ``Optimizer.__init__`` and forwards ``step()`` to the optimizer
it holds as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, which steps it only
when gradients are synchronized, through its GradScaler under fp16) has no hooks of its
own: the optimizer it holds is hooked instead, so a step is heard when one really runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def stepped(opt: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` runs: ``opt``, or the one a hook-less wrapper forwards to (None: none)."""
    seen: set[int] = set()
    while not hasattr(opt, "_optimizer_step_pre_hooks"):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or id(inner) in seen:
            return None
        seen.add(id(inner))
        opt = inner
    return opt


def _with_base(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    opt = stepped(opt) or opt
    base = getattr(opt, "base_optimizer", None)
    return [opt, base] if isinstance(base, torch.optim.Optimizer) and base is not opt else [opt]


def _start(args: tuple, kwargs: dict, on_start: Callable[[], None], defer: Callable[[], bool] | None) -> Any:
    """The step's optimizer phase begins now, or, given a closure (``opt.step(closure)``: Lightning's manual
    optimization, LBFGS) before any backward of the step (``defer()``), once the closure's first call returns:
    its forward and backward are the step's own, as in a loop that calls them before ``step()``.  (After the
    step's backward, SAM's, a closure is the optimizer's re-evaluation: the phase begins now.)  Returns the
    step's arguments with the closure wrapped (the pre-hook's way of changing them), or None."""
    # the hook's args are step()'s own, the optimizer first: a closure given by position is the second
    closure = kwargs.get("closure") if "closure" in kwargs else args[1] if len(args) > 1 else None
    if not callable(closure) or defer is None or not defer():
        on_start()
        return None
    first = [True]

    def timed_closure(*a: Any, **kw: Any) -> Any:
        if not first[0]:
            return closure(*a, **kw)  # a re-evaluation inside the step (LBFGS's line search): the optimizer's
        first[0] = False
        try:
            return closure(*a, **kw)
        finally:
            on_start()

    if "closure" in kwargs:
        return args, {**kwargs, "closure": timed_closure}
    return (args[0], timed_closure, *args[2:]), kwargs


class StepHooks:
    """Calls ``on_start()`` as an outer step begins (if given) and ``on_end(opt)`` as it ends."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        on_start: Callable[[], None] | None,
        on_end: Callable[[torch.optim.Optimizer], None],
        defer: Callable[[], bool] | None = None,
    ) -> None:
        self._depth: dict[int, int] = {}
        self._defer = defer  # True: a closure given now runs the step's forward and backward
        self._handles: list[Any] = []
        for opt in optimizers:
            self._depth[id(opt)] = 0
            for hooked in _with_base(opt):
                self._handles.append(hooked.register_step_pre_hook(self._pre(opt, on_start)))
                self._handles.append(hooked.register_step_post_hook(self._post(opt, on_end)))

    def _pre(self, outer: torch.optim.Optimizer, on_start: Callable[[], None] | None) -> Callable[..., Any]:
        depth, key = self._depth, id(outer)

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
            d = depth[key]
            depth[key] = d + 1
            if d == 0 and on_start is not None:
                return _start(args, kwargs, on_start, self._defer)
            return None

        return hook

    def _post(self, outer: torch.optim.Optimizer, on_end: Callable[[torch.optim.Optimizer], None]) -> Callable[..., None]:
        depth, key = self._depth, id(outer)

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            d = depth[key] = max(0, depth[key] - 1)
            if d == 0:
                on_end(outer)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def optimizer_info(optimizers: Any) -> list[dict[str, Any]]:
    """Each optimizer's type and its fused and foreach settings, as the summary file's context says them."""
    out = []
    for opt in optimizers or ():
        opt = stepped(opt) or opt  # the optimizer a wrapper (accelerate's) steps: its type is the one that says
        defaults = getattr(opt, "defaults", {}) or {}
        out.append({"type": type(opt).__name__, "fused": defaults.get("fused"), "foreach": defaults.get("foreach")})
    return out
