"""Marks on a clock: timing events on a CUDA stream, or the host's perf counter.

A *mark* is an opaque token taken at a boundary between two phases.  The time
between two marks of the same clock is what a phase lasted.  Both clocks share
one small interface (``mark``, ``done``, ``wait``, ``elapsed_ms``, ``release``)
so everything above them is written once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from phase_timer._env import native_wanted

log = logging.getLogger(__name__)


class Clock(Protocol):
    """What the recorder and the resolver need from a clock."""

    kind: str
    #: Bumped whenever marks start going to another stream.  Marks taken under one
    #: epoch complete in order, so the last one being done means all are.
    stream_epoch: int

    def mark(self) -> Any: ...
    def done(self, mark: Any) -> bool: ...
    def wait(self, mark: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def spans(self, marks: list[Any]) -> list[float]: ...
    def release(self, marks: list[Any]) -> None: ...



class HostClock:
    """``time.perf_counter_ns`` marks: the CPU, or any device without timing events."""

    kind = "host"
    stream_epoch = 0

    def mark(self) -> int:
        return time.perf_counter_ns()

    def done(self, mark: int) -> bool:
        return True

    def wait(self, mark: int) -> None:
        return None

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def spans(self, marks: list[int]) -> list[float]:
        return [(b - a) / 1e6 for a, b in zip(marks, marks[1:])]

    def release(self, marks: list[Any]) -> None:
        return None

    @property
    def live_marks(self) -> int:
        return 0


class CudaClock:
    """Timing events from a pool, recorded on the stream that is current at each mark.

    ``torch.cuda.current_stream()`` costs ~8 us a call because it builds a Python
    object, so the stream object is cached and only its raw handle is re-read
    (``_cuda_getCurrentRawStream``, an integer) to notice a stream switch.
    Nothing here waits for the device except :meth:`wait`, which only the final
    drain calls.
    """

    kind = "cuda"

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        try:
            self.device = _cuda_device(device)
        except ValueError as err:
            raise ValueError(f"CudaClock(device={device!r}): {err}") from None
        self._index: int = self.device.index  # type: ignore[assignment]
        self._pool: list[torch.cuda.Event] = []
        self._created = 0
        self.stream_epoch = 0
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._stream = torch.cuda.current_stream(self.device)
        self._stream_handle = self._stream.cuda_stream
        # Bound C methods: skip the Python wrappers of torch.cuda.Event (one frame each).
        base = torch._C._CudaEventBase
        self._record = base.record
        self._query = base.query
        self._elapsed = base.elapsed_time

    def _current_stream_handle(self) -> int:
        if self._raw_stream is None:  # very old torch: pay for the stream object
            return torch.cuda.current_stream(self.device).cuda_stream
        return self._raw_stream(self._index)

    def mark(self) -> torch.cuda.Event:
        pool = self._pool
        event = pool.pop() if pool else self._new_event()
        raw = self._raw_stream
        # ~0.1 us: the current stream's raw handle, to notice that the work moved.
        if (raw(self._index) if raw is not None else self._current_stream_handle()) != self._stream_handle:
            self._stream = torch.cuda.current_stream(self.device)
            self._stream_handle = self._stream.cuda_stream
            self.stream_epoch += 1
        self._record(event, self._stream)
        return event

    def _new_event(self) -> torch.cuda.Event:
        self._created += 1
        return torch.cuda.Event(enable_timing=True)

    def done(self, mark: torch.cuda.Event) -> bool:
        return self._query(mark)

    def wait(self, mark: torch.cuda.Event) -> None:
        # HOST-DEVICE SYNC: blocks until the device reaches this event.  Called only
        # by Resolver.drain(), once, when training ends.
        mark.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        # Both events are complete when this is called (done() said so): no wait.
        return self._elapsed(start, end)

    def spans(self, marks: list[torch.cuda.Event]) -> list[float]:
        elapsed = self._elapsed
        return [elapsed(a, b) for a, b in zip(marks, marks[1:])]

    def release(self, marks: list[Any]) -> None:
        self._pool.extend(marks)

    @property
    def live_marks(self) -> int:
        """Events created and not back in the pool: bounded by the pending records."""
        return self._created - len(self._pool)


def _cuda_device(device: torch.device | int | str | None) -> torch.device:
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


try:
    from phase_timer._native import Clock as _DriverClock
except ImportError:  # not built (no C compiler at install): torch's events are used
    _DriverClock = None


if _DriverClock is not None:

    class NativeCudaClock(_DriverClock):  # type: ignore[misc, valid-type]
        """The same clock as :class:`CudaClock`, on the CUDA driver API in C (``native/clock.c``).

        A mark is a small int naming a pooled ``CUevent``; ``mark()`` is one C call
        (1.3 us with its release on an H200 host, against 1.6-1.9 us for torch's
        ``Event.record`` and its Python), and ``spans()`` resolves a step's marks in
        one call (1.0 us against 2.5-3.1 us for 4 ``elapsed_time``).  The events live in the
        device's primary context, the one torch's CUDA runtime uses, so they are
        recorded on torch's streams as they are.  Nothing here waits for the device
        except :meth:`wait`, which only the final drain calls.
        """

        kind = "cuda"

        def __init__(self, device: torch.device | int | str | None = None) -> None:
            dev = _cuda_device(device)
            super().__init__(dev.index, torch._C._cuda_getCurrentRawStream)
            self.device = dev

else:  # pragma: no cover - depends on the build
    NativeCudaClock = None  # type: ignore[assignment, misc]


def make_clock(device: torch.device | str | int | None) -> HostClock | CudaClock:
    """The clock for work on ``device``: CUDA events where they exist, else the host.

    On CUDA the native driver-API clock is used when it was built and loads;
    otherwise (or with ``PHASE_TIMER_NATIVE=0``) torch's events, with the same results.
    """
    if device is None:
        return HostClock()
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        if NativeCudaClock is not None and native_wanted():
            try:
                return NativeCudaClock(dev)
            except Exception as err:  # noqa: BLE001 - e.g. an unusual driver: torch's events work everywhere
                log.info("phase-timer: native CUDA clock unavailable (%s); using torch's events", err)
        return CudaClock(dev)
    return HostClock()
