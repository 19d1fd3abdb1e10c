"""Small honest doubles: a clock whose events complete after a set number of polls."""

from __future__ import annotations

from dataclasses import dataclass


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
