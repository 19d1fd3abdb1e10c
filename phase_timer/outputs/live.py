"""The live file: ``phase_timer_live.json``, rewritten each window by rank zero on a writer thread.

What ``phase-timer watch`` reads while a run trains.  The TensorBoard files hold the same scalars,
but a logger's writer may hold them back for minutes (a ``SummaryWriter`` flushes every 120 s), and
they say nothing of the verdict so far nor of phase-timer's own cost.  This sink keeps the newest
value of every scalar it is given, a short history of the headline values for their trend, and each
phase's running total (``mean x steps``), and writes them as one small JSON object, atomically (a
temporary file, then a rename: a reader never sees half a file).

It runs behind a :class:`~phase_timer.outputs.sinks.BackgroundSink`: the training thread only puts
the scalars it already made on a queue.  The file is written at a window's scalars and at the
ranks' (not at per-step or memory writes, which only update what it holds), at most once a second
(``INTERVAL_S``), and once more at the end, with ``"status": "ended"``.  ``state`` (the core's :meth:`live_view`) is called on the writer
thread: the verdict so far and the own cost; a failure there leaves them out of that write.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from phase_timer import files
from phase_timer.outputs.tags import RANKS_TAG, WINDOW_PREFIX, WINDOW_STEPS_TAG

LIVE_NAME = "phase_timer_live.json"
LIVE_SCHEMA = "phase-timer/live"
LIVE_VERSION = 1
#: At most one write of the file a second while the run goes on (a watcher redraws once a second; windows that
#: come faster only update what the sink holds), and one at the end: the writer thread's cost is bounded by time,
#: not by the windows' rate.
INTERVAL_S = 1.0
#: Windows the history keeps (the trend's span); older ones are dropped.
HISTORY = 64
#: What each history entry keeps of a window: its step, steps, period and the rates.
_HEADLINE = {"period_ms": f"{WINDOW_PREFIX}/period_ms/mean", "samples_per_s": "throughput/samples_per_s",
             "tokens_per_s": "throughput/tokens_per_s", "mfu": "throughput/mfu",
             "job_tokens_per_s": "throughput/job_tokens_per_s", "job_samples_per_s": "throughput/job_samples_per_s"}
_MEAN_SUFFIX = "_ms/mean"


class LiveFile:
    """A sink that keeps a run's newest values and writes them to ``<directory>/phase_timer_live.json``."""

    def __init__(self, directory: str, state: Callable[[], dict[str, Any]] | None = None,
                 interval_s: float = INTERVAL_S) -> None:
        self.path = files.join(directory, LIVE_NAME)
        self._state = state
        self._interval_s = interval_s
        self._next_dump = 0.0  # time.monotonic() from which the next window's write goes to the file
        self._scalars: dict[str, float] = {}
        self._history: deque[dict[str, float]] = deque(maxlen=HISTORY)
        self._totals: dict[str, list[float]] = {}  # phase -> [sum of mean x steps, steps]
        self._windows = 0
        self._step = 0
        self._text: str | None = None
        self._started = time.time()
        self.writes = 0
        #: Nanoseconds this sink spent writing (the writer thread's, not the training thread's).
        self.write_ns = 0

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._scalars.update(scalars)
        self._step = max(self._step, step)
        steps = scalars.get(WINDOW_STEPS_TAG)
        if steps is not None:
            self._window(step, steps, scalars)
        if (steps is not None or RANKS_TAG in scalars) and time.monotonic() >= self._next_dump:
            self._next_dump = time.monotonic() + self._interval_s
            self._dump("running")

    def _window(self, step: int, steps: float, scalars: dict[str, float]) -> None:
        self._windows += 1
        entry = {"step": step, "steps": steps}
        entry.update({k: scalars[tag] for k, tag in _HEADLINE.items() if tag in scalars})
        self._history.append(entry)
        for tag, v in scalars.items():
            if tag.startswith(WINDOW_PREFIX + "/") and tag.endswith(_MEAN_SUFFIX):
                phase = tag[len(WINDOW_PREFIX) + 1:-len(_MEAN_SUFFIX)]
                total = self._totals.setdefault(phase, [0.0, 0.0])
                total[0] += v * steps
                total[1] += steps

    def write_text(self, tag: str, text: str, step: int) -> None:
        self._text = text.replace("  \n", "\n")  # the verdict, once, at the end (markdown line breaks undone)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._dump("ended")

    def _dump(self, status: str) -> None:
        t0 = time.perf_counter_ns()
        state: dict[str, Any] = {}
        if self._state is not None:
            try:
                state = self._state() or {}
            except Exception:  # noqa: BLE001 - read while the run changes it: this write goes without it
                state = {}
        data = {
            "schema": LIVE_SCHEMA, "version": LIVE_VERSION, "status": status, "pid": os.getpid(),
            "host": socket.gethostname(), "started": self._started, "updated": time.time(), "step": self._step,
            "windows": self._windows, "scalars": self._scalars, "history": list(self._history),
            "totals": {p: {"total_ms": t, "steps": n} for p, (t, n) in self._totals.items()},
            "verdict_text": self._text, **state,
        }
        files.write(self.path, json.dumps(data, separators=(",", ":"), default=str).encode())
        self.writes += 1
        self.write_ns += time.perf_counter_ns() - t0
