"""The boundaries' side of memory per phase: a memory step's reads, handed to the Memory measure's tracker.

A memory step (:mod:`phase_timer.measures.memory` says which steps are) reads the allocator's counters at each
boundary it passes; :class:`MemorySteps` is what the boundaries do for it, on their own slots (``_mem``: the
tracker, None when memory is not read; ``_mem_on``: this step is one; ``_mem_due``: the step begun at which the next
one is due).  The C boundaries (``_native.Fast``) read those three by name and take the methods' path whenever a
memory step is on or due, so these run only on memory steps and at pauses and the run's end.
"""

from __future__ import annotations

import time
from typing import Any

from phase_timer.outputs.tags import memory_scalars


class MemorySteps:
    """The memory step's hand-off, mixed into the boundaries (no slots of its own: theirs)."""

    __slots__ = ()

    def _plan_memory(self, core: Any) -> None:
        """The Memory measure's tracker (``memory.MemoryTracker``), the core's ``memory`` (None: memory is not read)."""
        memory = core.measure("memory")
        self._mem = memory.tracker if memory is not None else None
        self._mem_on = False  # this step is a memory step
        self._mem_due = self._mem.next_due if self._mem is not None else 0

    def _mem_read(self, phase: str) -> None:
        mem = self._mem
        if mem.full:  # a step that never ends (no optimizer step heard): its reads stop here
            self._mem_end(mem.drop)
        elif not self._mem_call(mem.read, phase):
            self._mem_on = False

    def _mem_end(self, fn: Any, *args: Any) -> None:
        """The memory step is over (closed, dropped, or read full): ``fn`` folds it in; the next one is due."""
        self._mem_on = False
        if self._mem_call(fn, *args):
            self._mem_due = self._mem.next_due  # type: ignore[union-attr]

    def _mem_closed(self) -> None:
        """The memory step closed: its values (MB) go to the sinks at its step (``phase_memory/<what>_mb``)."""
        tracker = self._mem
        scalars = memory_scalars(tracker.end_step())
        self.core.add_row(tracker.step, scalars)

    def _mem_mark(self, phase: str) -> None:
        """A read at a pause's begin or end or at the run's end; inside a memory step, one of its reads."""
        if self._mem_on:
            self._mem_read(phase)
        elif self._mem is not None:
            self._mem_call(self._mem.mark, phase, self.begun, self._step)

    def _mem_call(self, fn: Any, *args: Any) -> bool:
        """A call on the memory tracker, its host time counted; a failure warns once and memory stops, the
        training goes on."""
        t0 = time.perf_counter_ns()
        try:
            fn(*args)
            self._mem.own_ns += time.perf_counter_ns() - t0  # type: ignore[union-attr]
            return True
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            if self._mem is not None:  # what was read stays, with why it stopped
                self._mem.failed = f"{type(err).__name__}: {err}"
            self._mem, self._mem_on = None, False
            self._warn_once("memory", f"phase-timer: memory is no longer read ({type(err).__name__}: {err}); "
                                      "the time phases go on")
            return False
