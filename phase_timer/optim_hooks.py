"""Optimizer step hooks that see one step per outer ``optimizer.step()`` call.

PyTorch wraps ``step`` of every optimizer class it has hooked, so when a subclass's
``step`` calls ``super().step()`` and the base class was hooked too (any instance of
it existed), the pre/post hooks fire at both levels.  Counting the depth per
optimizer keeps the inner pair from ending the phase early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class StepHooks:
    """Calls ``on_start(opt)`` as an outer step begins and ``on_end(opt)`` as it ends."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        on_start: Callable[[torch.optim.Optimizer], None],
        on_end: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        self._depth: dict[int, int] = {}
        self._handles: list[Any] = []
        for opt in optimizers:
            self._depth[id(opt)] = 0
            self._handles.append(opt.register_step_pre_hook(self._pre(on_start)))
            self._handles.append(opt.register_step_post_hook(self._post(on_end)))

    def _pre(self, on_start: Callable[[torch.optim.Optimizer], None]) -> Callable[..., None]:
        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            depth = self._depth[id(opt)]
            self._depth[id(opt)] = depth + 1
            if depth == 0:
                on_start(opt)

        return hook

    def _post(self, on_end: Callable[[torch.optim.Optimizer], None]) -> Callable[..., None]:
        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            depth = self._depth[id(opt)] = max(0, self._depth[id(opt)] - 1)
            if depth == 0:
                on_end(opt)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
