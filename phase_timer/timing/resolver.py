"""The FIFO of records waiting for the device: resolved lazily, never waited on.

``poll()`` asks whether the pending records' last marks are done (``Event.query()``):
the newest it may ask first, which answers for all of them when they are on one stream,
else each, oldest first, stopping at the first that is not.  It never blocks and
resolves at most ``max_per_poll`` records a call.  The core polls every few closes
(``engine.POLL_EVERY``), so that one query and one run of resolution serve several steps.  The newest ``lag`` records
are never asked (see ``Resolver.__init__``).  ``drain()`` is the one
place that waits for the device, and only the end of training calls it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from phase_timer.timing.clock import Clock
from phase_timer.phases import FETCH, PAUSED, after_end, part_of
from phase_timer.timing.recorder import Record


@dataclass(slots=True)
class StepTimes:
    """A resolved step: milliseconds per phase, with ``step`` the sum of the device spans."""

    step: int
    ms: dict[str, float]
    #: Traced steps only: (phase, start, end) per span, device ms from the trace's
    #: reference mark, and the host ns of each boundary.
    device_spans: list[tuple[str, float, float]] | None = None
    host_ns: list[int] | None = None


def resolve(clock: Clock, record: Record, prev: Any = None) -> StepTimes:
    """Milliseconds per phase of a record whose marks are all done; its marks but the last go back to the pool.

    Spans before the record's end are the step's (they add up to ``step``); later ones
    are between steps (built-in phases fold into ``between_steps``, a custom one becomes
    ``between_steps.<name>``: :func:`~phase_timer.phases.after_end`); paused spans are nobody's; a micro-batch's
    fetch (``FETCH``) is no phase's and not the step's (the host's ``data_wait`` holds it), but the period's.
    With ``prev``, the last mark of the record it follows (``Record.prev``; done, on the same stream),
    ``period`` is on the marks' clock: from ``prev`` to the record's last mark, less its paused spans.
    So no step is longer than its period, on any rank; else ``period`` is the host's, as the core gave it, or the
    record's own time where that is longer (a lower bound of the period on the marks' clock).
    The caller gives the last mark back (:class:`Resolver` keeps it for the record that follows).
    """
    marks = record.marks
    ms = record.host_ms  # host phases are in already; device phases join them
    durations = clock.spans(marks)  # one call: len(marks) - 1 elapsed times
    end = record.end if record.end >= 0 else len(durations)
    labels = [after_end(label) if i >= end else label for i, label in enumerate(record.labels)]
    get = ms.get
    step = 0.0
    held = 0.0  # every span but the paused ones
    for i, (label, span) in enumerate(zip(labels, durations)):
        if label == PAUSED:
            continue
        held += span
        if label == FETCH:
            continue
        if i < end:
            step += span
            whole = part_of(label)
            if whole is not None:  # "of which": the wait for collectives is its phase's time too
                ms[whole] = get(whole, 0.0) + span
        ms[label] = get(label, 0.0) + span
    ms["step"] = step
    if prev is not None:
        ms["period"] = clock.elapsed_ms(prev, marks[0]) + held
    elif ms.get("period", held) < held:  # the host's is short of the record's own time: at least that
        ms["period"] = held
    spans = None
    if record.ref is not None:  # traced: every mark against the one reference, on the device clock
        elapsed = clock.elapsed_ms
        offsets = [elapsed(record.ref, m) for m in marks]
        spans = [(label, offsets[i], offsets[i + 1]) for i, label in enumerate(labels)]
    clock.release(marks[:-1])
    return StepTimes(record.step, ms, spans, record.host_ns)


class Resolver:
    """Pending records in order; bounded by ``max_pending``."""

    def __init__(self, clock: Clock, *, max_pending: int, max_per_poll: int = 4, lag: int = 2) -> None:
        self._clock = clock
        self._pending: deque[Record] = deque()
        self.max_pending = max_pending
        self._max_per_poll = max_per_poll
        # Only records with `lag` younger ones behind them are asked: querying an
        # event the host has just recorded makes the driver flush the stream's
        # batched launches (~40 us a step on a launch-bound loop, measured).
        self._lag = min(lag, max_pending - 1)
        self._blocked = False  # the last poll stopped at a record the device had not finished
        # The last resolved record's last mark, its seq and its stream epoch (-1: not on one stream): the start
        # of the next record's period when that one follows it (``Record.prev``).
        self._held: tuple[Any, int, int] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.max_pending

    def push(self, record: Record) -> None:
        """Queue a closed record.  Callers check :attr:`full` first (the core skips the step)."""
        self._pending.append(record)

    def poll(self) -> list[StepTimes]:
        """Resolve what the device has finished, oldest first, without waiting.

        When the records it may ask are all on one stream, one query of the newest of them answers for
        all (one stream completes in order); else each is asked, oldest first, up to the first not done.
        """
        pending, lag = self._pending, self._lag
        self._blocked = False
        if len(pending) <= lag:
            return []
        out: list[StepTimes] = []
        known = self._batch_done(len(pending) - lag)
        while len(pending) > lag and len(out) < self._max_per_poll:
            if len(out) >= known and not self._done(pending[0]):
                self._blocked = True
                break
            out.append(self._resolve(pending.popleft()))
        return out

    def _resolve(self, record: Record) -> StepTimes:
        held = self._held
        follows = (held is not None and record.prev >= 0 and record.prev == held[1] and record.single_stream
                   and held[2] == record.epoch)
        times = resolve(self._clock, record, held[0] if follows else None)
        if held is not None:
            self._clock.release([held[0]])
        self._held = (record.marks[-1], record.seq, record.epoch if record.single_stream else -1)
        return times

    def release(self) -> None:
        """Give back the mark kept for the next record's period (the end of training: nothing follows)."""
        if self._held is not None:
            self._clock.release([self._held[0]])
            self._held = None

    def _batch_done(self, eligible: int) -> int:
        """``eligible`` if the oldest ``eligible`` records are on one stream and the newest of them is done, else 0."""
        if eligible < 2:
            return 0
        pending = self._pending
        newest = pending[eligible - 1]
        for k in range(eligible):
            r = pending[k]
            if not r.single_stream or r.epoch != newest.epoch:
                return 0
        return eligible if self._clock.done(newest.marks[-1]) else 0

    def _done(self, record: Record) -> bool:
        done = self._clock.done
        # One stream: events complete in order, so the last mark done means all are.
        return done(record.marks[-1]) if record.single_stream else all(done(m) for m in record.marks)

    def in_flight(self) -> int:
        """The closed records before the newest that the device has not finished; never waits.

        After a poll that stopped at an unfinished record, every younger one is unfinished
        too (no query); else a binary search, never asking the newest record (see ``lag``).
        """
        pending = self._pending
        n = len(pending) - 1
        if n <= 0:
            return 0
        if self._blocked:
            return n
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if self._done(pending[mid]):
                lo = mid + 1
            else:
                hi = mid
        return n - lo

    def newest_done(self) -> bool | None:
        """Whether the device has finished the newest record's step (its end mark); one query, never waits."""
        if not self._pending:
            return None
        record = self._pending[-1]
        return self._clock.done(record.marks[record.end if record.end >= 0 else -1])

    def drain(self) -> list[StepTimes]:
        """Resolve everything, waiting for the device: call once, at the end of training."""
        out = []
        while self._pending:
            record = self._pending.popleft()
            # HOST-DEVICE SYNC (end of training only): wait for every mark's stream.
            for mark in record.marks if not record.single_stream else record.marks[-1:]:
                self._clock.wait(mark)
            out.append(self._resolve(record))
        self.release()
        return out
