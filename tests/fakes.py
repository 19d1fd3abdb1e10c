"""Small honest doubles: a clock whose events complete after a set number of polls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FakeEvent:
    time_ms: float
    polls_left: int
    stream: int = 0
    seq: int = 0
    waited: bool = False

    def query(self) -> bool:
        if self.polls_left > 0:
            self.polls_left -= 1
            return False
        return True


class FakeClock:
    """Marks advance a fake device clock by ``tick_ms``; each completes after ``lag`` polls.

    Like a CUDA stream, events of one stream complete in order: when one is done,
    every earlier event of its stream is done too.  ``wait`` completes an event at
    once and counts how often the device was waited on.
    """

    kind = "fake"

    def __init__(self, *, tick_ms: float = 1.0, lag: int = 0) -> None:
        self.now = 0.0
        self.tick_ms = tick_ms
        self.lag = lag
        self.stream_epoch = 0
        self.queries = 0
        self.waits = 0
        self.released: list[FakeEvent] = []
        self.created = 0
        self._events: list[FakeEvent] = []

    def mark(self) -> FakeEvent:
        self.now += self.tick_ms
        self.created += 1
        event = FakeEvent(self.now, self.lag, stream=self.stream_epoch, seq=self.created)
        self._events.append(event)
        return event

    def _complete_up_to(self, mark: FakeEvent) -> None:
        for ev in self._events:
            if ev.stream == mark.stream and ev.seq <= mark.seq:
                ev.polls_left = 0
        self._events = [ev for ev in self._events if ev.polls_left > 0]

    def done(self, mark: FakeEvent) -> bool:
        self.queries += 1
        if mark.query():
            self._complete_up_to(mark)
            return True
        return False

    def wait(self, mark: FakeEvent) -> None:
        self.waits += 1
        mark.waited = True
        self._complete_up_to(mark)

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.polls_left == 0 and end.polls_left == 0, "elapsed_ms on an event that is not done"
        return end.time_ms - start.time_ms

    def spans(self, marks: list[FakeEvent]) -> list[float]:
        return [self.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]

    def release(self, marks: list[FakeEvent]) -> None:
        self.released.extend(marks)

    @property
    def live_marks(self) -> int:
        return self.created - len(self.released)


class ListSink:
    def __init__(self) -> None:
        self.writes: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.writes.append((step, dict(scalars)))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class FakeAllocator:
    """A caching allocator's counters, moved by the test (MB): allocations and frees planted where it wants.

    ``reserved`` follows the allocated peak plus ``slack_mb`` (a cache that never gives memory back);
    ``read`` and ``info`` are what :func:`phase_timer.measures.memory.reader_for` returns on CUDA.
    """

    MB = 1 << 20

    def __init__(self, *, total_mb: float = 80 * 1024, slack_mb: float = 0.0, other_mb: float = 0.0) -> None:
        self.allocated = self.peak = self.reserved = self.peak_reserved = 0.0
        self.total_mb, self.slack_mb, self.other_mb = total_mb, slack_mb, other_mb
        self.retries = 0
        self.reads = 0

    def alloc(self, mb: float) -> None:
        self.allocated += mb
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated + self.slack_mb)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, mb: float) -> None:
        self.allocated -= mb

    def reset_peak(self) -> None:
        """What ``torch.cuda.reset_peak_memory_stats()`` does: the peaks start again from now."""
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def read(self) -> Any:
        from phase_timer.measures.memory import Reading

        self.reads += 1
        b = lambda mb: int(mb * self.MB)  # noqa: E731
        return Reading(b(self.allocated), b(self.reserved), b(self.peak), b(self.peak_reserved), self.retries)

    def info(self) -> tuple[int, int]:
        total = int(self.total_mb * self.MB)
        return total - int((self.reserved + self.other_mb) * self.MB), total
