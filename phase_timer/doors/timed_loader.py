"""``timer.loader``: the plain door's wrapper of the user's loader.

It tells the timer where each fetch begins, how long the wait for the batch took, and where
the loader ends (or the loop leaves it); with ``copy_to_device=True`` the timer's
``_on_batch`` copies each batch.  A disabled timer's wrapper still copies when asked to: the
loop relies on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from phase_timer._env import warn

if TYPE_CHECKING:
    from phase_timer.doors.plain_hooks import PlainHooks

log = logging.getLogger(__name__)


class TimedLoader:
    """Iterates the user's loader: each fetch, the wait for each batch, the loader's end."""

    def __init__(self, timer: PlainHooks, loader: Iterable[Any]) -> None:
        self._timer = timer
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        timer = self._timer
        if timer.__dict__.get("_closed"):
            warn(log, "phase-timer: timer.loader is iterated after the timer was closed: these batches are not timed "
                      "(attach a new timer for a new run)", 2)
        it = iter(self._loader)
        fetch, on_batch = timer._fetch, timer._on_batch
        core, bounds = timer.core, timer._bounds
        count = bounds.count_batch if bounds is not None and core is not None and (bounds.counter or bounds.flops) else None
        try:
            while True:
                fetch()
                t0 = time.perf_counter_ns()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                out = on_batch(batch, t0)
                if count is not None and timer._loader_active:  # the step's samples/tokens and FLOPs, from shapes
                    count(batch)
                yield out
        finally:  # the loader ran out, or the loop left it (break, an exception): a cut-off step is dropped
            timer._epoch_end()

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
