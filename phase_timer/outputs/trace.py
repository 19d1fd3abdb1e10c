"""A Chrome / Perfetto trace (JSON trace-event format) of chosen steps' phases.

Two tracks: the device (every boundary measured with ``elapsed_time`` against one
reference event recorded when tracing starts, so the boxes sit where the device
ran them) and the host (``perf_counter_ns`` at the same boundaries).  Both tracks
put time 0 at the reference: the host recorded it then; the device reached it
then or later, so device boxes may sit to the right of the host ones that
launched them (the host running ahead).  Open the file in https://ui.perfetto.dev
or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from typing import Any

from phase_timer import files
from phase_timer.phases import PAUSED
from phase_timer.timing.resolver import StepTimes

_DEVICE_PID, _HOST_PID = 1, 2


class TraceWriter:
    """Collects traced steps and writes the JSON file once, at the end."""

    def __init__(self, path: str | os.PathLike[str], first: int, stop: int, clock: str) -> None:
        self.path = os.fspath(path)
        self.first, self.stop = first, stop
        self.clock = clock
        self.ref_host_ns: int | None = None
        self.ref: Any = None
        self._events: list[dict[str, Any]] = []

    def wants(self, step: int) -> bool:
        return self.first <= step < self.stop

    def add(self, r: StepTimes) -> None:
        if r.device_spans is None or r.host_ns is None or self.ref_host_ns is None:
            return
        for i, (phase, start, end) in enumerate(r.device_spans):
            if phase == PAUSED:  # evaluation inside the record: nobody's time
                continue
            self._box(phase, r.step, _DEVICE_PID, start * 1e3, (end - start) * 1e3)
            h0, h1 = r.host_ns[i], r.host_ns[i + 1]
            self._box(phase, r.step, _HOST_PID, (h0 - self.ref_host_ns) / 1e3, (h1 - h0) / 1e3)

    def _box(self, phase: str, step: int, pid: int, ts_us: float, dur_us: float) -> None:
        self._events.append(
            {"name": phase, "cat": "phase", "ph": "X", "pid": pid, "tid": 0, "ts": round(ts_us, 3),
             "dur": round(max(dur_us, 0.0), 3), "args": {"step": step}}
        )

    def write(self) -> str:
        meta = [
            {"name": "process_name", "ph": "M", "pid": _DEVICE_PID, "args": {"name": f"device ({self.clock} clock)"}},
            {"name": "process_name", "ph": "M", "pid": _HOST_PID, "args": {"name": "host"}},
            {"name": "process_sort_index", "ph": "M", "pid": _DEVICE_PID, "args": {"sort_index": 0}},
            {"name": "process_sort_index", "ph": "M", "pid": _HOST_PID, "args": {"sort_index": 1}},
        ]
        data = json.dumps({"traceEvents": meta + self._events, "displayTimeUnit": "ms"})
        return files.write(self.path, data.encode())  # a local file, or the logger's fsspec URL
