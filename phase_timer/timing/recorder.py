"""One record per training step: its boundaries (marks) in order, and what each span was.

Phases are contiguous: N+1 marks give N spans, and the spans before the step's
end add up exactly to the step.  A span is labelled with the phase that *starts*
at its first mark, so a phase that happens several times in a step (forward and
backward under gradient accumulation, ``optimizer`` with several optimizers) is
summed.  A record goes on past the step's end (:meth:`Recorder.end`) until the
next batch is fetched: those spans are the time between steps.

Records are numbered as they close (``seq``), and each knows the one that closed
just before it opened (``prev``), unless something came between that no record
holds (a step left untimed or dropped, a pause outside a record: :meth:`Recorder.cut`).
Then the step's ``period`` is measured on the same clock as its phases, from the
previous record's last mark to its own last mark (``resolver.resolve``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from phase_timer.timing.clock import Clock
from phase_timer.phases import BETWEEN


@dataclass(slots=True)
class Record:
    """A closed step waiting to be resolved: ``labels[i]`` names ``marks[i] -> marks[i+1]``."""

    step: int
    marks: list[Any]
    labels: list[str]
    single_stream: bool = True
    #: The clock's stream epoch at the open: two single-stream records with the same one are on one stream.
    epoch: int = 0
    #: The step's device part ends at ``marks[end]``; later spans are between steps (-1: at the last mark).
    end: int = -1
    #: Phases measured on the host clock, already in milliseconds (``data_wait``, ``period``).
    host_ms: dict[str, float] = field(default_factory=dict)
    #: Traced steps only: the host time of each mark (ns), and the trace's reference mark.
    host_ns: list[int] | None = None
    ref: Any = None
    #: Its number, in the order records close (from 1).
    seq: int = 0
    #: The ``seq`` of the record that closed just before this one opened, with nothing between them that no
    #: record holds; -1 when there is none (the first record, or after :meth:`Recorder.cut`).
    prev: int = -1


class Recorder:
    """Turns ``open / switch / close`` calls into marks on one clock."""

    __slots__ = ("_clock", "_mark", "_marks", "_labels", "_current", "_step", "_epoch", "_host", "_host_ns", "_ref",
                 "_end", "_pre_end", "_seq", "_last", "_prev")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._mark = clock.mark
        self._marks: list[Any] | None = None
        self._labels: list[str] = []
        self._current = ""
        self._step = 0
        self._epoch = 0
        self._host: dict[str, float] = {}
        self._host_ns: list[int] | None = None
        self._ref: Any = None
        self._end = -1
        self._pre_end = BETWEEN
        self._seq = 0  # records closed
        self._last = -1  # the seq of the record closed last, while nothing untimed has come after it
        self._prev = -1  # the open record's prev

    @property
    def is_open(self) -> bool:
        return self._marks is not None

    @property
    def current(self) -> str | None:
        """The phase running now, or ``None`` outside a record."""
        return self._current if self._marks is not None else None

    def open(self, step: int, phase: str, trace_ref: Any = None) -> None:
        """Start a record at ``step`` whose first span is ``phase``.

        With ``trace_ref`` (a mark), the host time of every mark is kept too, and the
        record is resolved against that reference for the timeline trace.
        """
        if self._marks is not None:  # an open record is dropped
            self.discard()
        self._prev = self._last
        self._ref = trace_ref
        self._host_ns = [] if trace_ref is not None else None
        if self._host_ns is not None:
            self._host_ns.append(time.perf_counter_ns())
        self._marks = [self._mark()]
        self._labels = []
        self._current = phase
        self._step = step
        self._epoch = self._clock.stream_epoch
        self._host = {}
        self._end = -1

    def switch(self, phase: str) -> None:
        """End the running span and start ``phase``; free when ``phase`` is already running."""
        marks = self._marks
        if marks is None or phase == self._current:
            return
        if self._host_ns is not None:
            self._host_ns.append(time.perf_counter_ns())
        marks.append(self._mark())
        self._labels.append(self._current)
        self._current = phase

    def end(self, phase: str = BETWEEN) -> None:
        """The step's device part ends here (a mark); until :meth:`close`, spans are between steps.

        What runs next is labelled ``phase`` (a user phase still open; else ``between_steps``).
        A later ``end()`` moves the end there; a second one with nothing switched in
        between continues the label that ran into the first (a GradScaler's update).
        """
        marks = self._marks
        if marks is None:
            return
        label = self._current
        if label == BETWEEN and self._end >= 0:
            label = self._pre_end
        if self._host_ns is not None:
            self._host_ns.append(time.perf_counter_ns())
        marks.append(self._mark())
        self._pre_end = label
        self._labels.append(label)
        self._end = len(marks) - 1
        self._current = phase

    def relabel(self, phase: str) -> None:
        """Rename the running span (no mark): what it turned out to be is known only later."""
        if self._marks is not None:
            self._current = phase

    def behind(self) -> bool | None:
        """The device has not passed the mark before the newest: it has not begun the span the host just
        issued (one query of a mark a phase old, never a wait).  None on the host clock or before two marks."""
        marks = self._marks
        if marks is None or len(marks) < 2 or self._clock.kind == "host":
            return None
        return not self._clock.done(marks[-2])

    def add_host(self, phase: str, ms: float) -> None:
        if self._marks is not None:
            self._host[phase] = self._host.get(phase, 0.0) + ms

    def close(self) -> Record | None:
        """Take the last mark and hand the record over; ``None`` if none was open."""
        marks = self._marks
        if marks is None:  # a step went untimed: the next record does not follow the last one
            self._last = -1
            return None
        if self._host_ns is not None:
            self._host_ns.append(time.perf_counter_ns())
        marks.append(self._mark())
        self._labels.append(self._current)
        self._marks = None
        self._seq += 1
        self._last = self._seq
        return Record(
            step=self._step,
            marks=marks,
            labels=self._labels,
            single_stream=self._clock.stream_epoch == self._epoch,
            epoch=self._epoch,
            host_ms=self._host,
            host_ns=self._host_ns,
            ref=self._ref,
            end=self._end,
            seq=self._seq,
            prev=self._prev,
        )

    def discard(self) -> None:
        """Drop an open record, giving its marks back (used when a step is abandoned)."""
        if self._marks is not None:
            self._clock.release(self._marks)
            self._marks = None
        self._last = -1

    def cut(self) -> None:
        """Time that no record holds comes next (a pause outside a record): the next record does not follow the
        last one, and its ``period`` is the host's."""
        self._last = -1


class NvtxRecorder(Recorder):
    """A Recorder that also pushes each span as an NVTX range, for Nsight Systems.

    Chosen only when asked for (``nvtx=True``), so the default path pays nothing.
    The ranges are host ranges with the phases' names; relabelled spans are
    re-pushed under their final name.
    """

    __slots__ = ("_push", "_pop")

    def __init__(self, clock: Clock, push: Any = None, pop: Any = None) -> None:
        super().__init__(clock)
        if push is None or pop is None:
            import torch.cuda.nvtx as nvtx

            push, pop = nvtx.range_push, nvtx.range_pop
        self._push, self._pop = push, pop

    def open(self, step: int, phase: str, trace_ref: Any = None) -> None:
        super().open(step, phase, trace_ref)
        self._push(phase)

    def switch(self, phase: str) -> None:
        if self._marks is None or phase == self._current:
            return
        super().switch(phase)
        self._pop()
        self._push(phase)

    def relabel(self, phase: str) -> None:
        if self._marks is not None and phase != self._current:
            self._pop()
            self._push(phase)
        super().relabel(phase)

    def end(self, phase: str = BETWEEN) -> None:
        if self._marks is not None:
            self._pop()
            super().end(phase)
            self._push(phase)

    def close(self) -> Record | None:
        if self._marks is not None:
            self._pop()
        return super().close()

    def discard(self) -> None:
        if self._marks is not None:
            self._pop()
        super().discard()
