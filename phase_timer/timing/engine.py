"""The per-step engine: the open record, the records waiting for the device, the window.

Two implementations with one interface, which ``TimingCore`` (``run/core.py``)
drives:

* ``_native.Steps`` (C, ``native/steps.c``): the default wherever it is built, on the
  native CUDA clock or on the host clock.  A step costs Python only the calls the
  hooks make.
* :class:`PyEngine` (this module): any clock (torch's events, test doubles), NVTX
  ranges and traced steps; the fallback when the extension is not built.

Both return results only when Python has something to do with them, as a list of
``("step", step, ms)`` (``per_step`` only), ``("trace", StepTimes)`` (traced steps,
PyEngine only) and ``("window", key, last_step, steps, columns)`` items, in step
order; ``None`` otherwise.  ``columns`` maps each phase to its values over the
window's steps, sorted.  Tests drive both with the same calls and compare.
"""

from __future__ import annotations

import time
from typing import Any

from phase_timer.timing.clock import Clock, HostClock, NativeCudaClock, native_wanted
from phase_timer.phases import BETWEEN, FETCH, PAUSED, after_end, part_of
from phase_timer.timing.recorder import NvtxRecorder, Recorder
from phase_timer.timing.resolver import Resolver, StepTimes
from phase_timer.timing.stats import Window

try:
    from phase_timer._native import Steps
except ImportError:  # not built: the Python engine everywhere
    Steps = None

#: The core polls every POLL_EVERY closes, not at each: a poll then finds several steps done, one query
#: of the newest answers for them all, and their resolution runs back to back, where each driver call
#: costs several times less than alone between a training step's kernel launches (``docs/benchmarks.md``).
#: Results come that many steps later; nothing waits.
POLL_EVERY = 8
#: At most this many records resolved a poll: twice what a poll's gap adds, so that a backlog drains.
MAX_PER_POLL = 2 * POLL_EVERY
#: On the native clock, the C engine asks the device and reads the spans on a thread of its own, which never
#: takes the GIL: the training thread only takes the results (``native/resolver.c``).  False: at the poll, inline.
RESOLVER_THREAD = True


class PyEngine:
    """The engine in Python: :class:`Recorder` -> :class:`Resolver` -> :class:`Window`."""

    def __init__(
        self,
        clock: Clock,
        *,
        window: int,
        max_pending: int,
        lag: int = 2,
        max_per_poll: int = MAX_PER_POLL,
        per_step: bool = False,
        nvtx: bool = False,
    ) -> None:
        self._recorder = NvtxRecorder(clock) if nvtx else Recorder(clock)
        self._resolver = Resolver(clock, max_pending=max_pending, lag=lag, max_per_poll=max_per_poll)
        self._window_size = window
        self._per_step = per_step
        self._window: Window | None = None
        # The hot path: bound methods, no extra frame.
        self.switch = self._recorder.switch
        self.end = self._recorder.end
        self.relabel = self._recorder.relabel
        self.add_host = self._recorder.add_host
        self.discard = self._recorder.discard
        self.cut = self._recorder.cut
        self.behind = self._recorder.behind

    @property
    def is_open(self) -> bool:
        return self._recorder.is_open

    @property
    def current(self) -> str | None:
        return self._recorder.current

    @property
    def pending(self) -> int:
        return len(self._resolver)

    @property
    def full(self) -> bool:
        return self._resolver.full

    @property
    def max_pending(self) -> int:
        return self._resolver.max_pending

    def open(self, step: int, phase: str, trace_ref: Any = None) -> None:
        self._recorder.open(step, phase, trace_ref)

    def close(self, period_ms: float) -> bool:
        """Queue the open record, with its ``period`` when ``period_ms >= 0``; False if none was open."""
        record = self._recorder.close()
        if record is None:
            return False
        if period_ms >= 0:
            record.host_ms["period"] = record.host_ms.get("period", 0.0) + period_ms
        self._resolver.push(record)
        return True

    def poll(self) -> list[tuple] | None:
        results = self._resolver.poll()
        return (self._results(results) or None) if results else None

    def in_flight(self) -> int:
        return self._resolver.in_flight()

    def newest_done(self) -> bool | None:
        return self._resolver.newest_done()

    def drain(self) -> list[tuple] | None:
        """Resolve everything, waiting for the device: only the end of training calls it."""
        return self._results(self._resolver.drain()) or None

    def flush(self) -> list[tuple] | None:
        """The window being filled, even if not complete (end of training)."""
        out: list[tuple] = []
        self._emit(out)
        return out or None

    def _emit(self, out: list[tuple]) -> None:
        window = self._window
        if window is not None:
            out.append(("window", window.key, window.last_step, window.steps, window.columns()))
            self._window = None

    def _results(self, steps: list[StepTimes]) -> list[tuple]:
        out: list[tuple] = []
        for r in steps:
            if r.device_spans is not None:
                out.append(("trace", r))
            if self._per_step:
                out.append(("step", r.step, r.ms))
            key = r.step // self._window_size
            if self._window is not None and self._window.key != key:
                self._emit(out)
            if self._window is None:
                self._window = Window(key)
            self._window.add(r.step, r.ms)
        return out


def native_steps(clock: Any, window: int, max_pending: int, lag: int = 2, per_step: bool = False,
                 threaded: bool = False) -> Any:
    """The C engine with the phase names both engines share (what a span is called after a step's end, what is
    paused, what is part of another phase, what is a micro-batch's fetch).

    ``threaded`` (a native clock): the records are asked and read on a thread of the engine's own, which never
    takes the GIL; ``poll()`` only takes what it resolved (``native/resolver.c``).
    """
    return Steps(clock, window, max_pending, lag, MAX_PER_POLL, per_step, BETWEEN, PAUSED, after_end, threaded, part_of,
                 FETCH)


def make_engine(
    clock: Clock,
    *,
    window: int,
    max_pending: int,
    lag: int = 2,
    per_step: bool = False,
    nvtx: bool = False,
    traced: bool = False,
) -> Any:
    """The C engine where it applies (built, wanted, a native or host clock, no NVTX, no trace), else PyEngine."""
    if Steps is not None and not nvtx and not traced and native_wanted():
        if NativeCudaClock is not None and isinstance(clock, NativeCudaClock):
            return native_steps(clock, window, max_pending, lag, per_step, threaded=RESOLVER_THREAD)
        if type(clock) is HostClock:
            return native_steps(time.perf_counter_ns, window, max_pending, lag, per_step)
    return PyEngine(clock, window=window, max_pending=max_pending, lag=lag, per_step=per_step, nvtx=nvtx)
