"""Where the CPU went while the run was input-bound: the training process, its training thread, the loader's workers.

The INPUT_BOUND advice depends on it: a loader whose batches are cheap to make gains nothing
from worker processes (handing a batch over costs as much), one whose batches wait on I/O gains
from more workers than cores, one whose batches are CPU work only as far as the cores carry.

Read at a few window ends (windows 1-4, then the 8th, 16th, 32nd, ...), never per step, on the
thread that resolves the windows (the training thread).  One reading is 30-120 µs: the process's
CPU clock; the thread's scheduler counters and each of its DataLoader workers', from Linux's
``/proc/<pid>/schedstat`` (time on a CPU, time waiting in the run queue for one; the rest of a
thread's wall time it slept: I/O, a queue, a lock); the CPU time of the workers already ended;
the machine's idle time.  Off Linux the scheduler counters are missing and the advice says what
it could not tell.

The loader's own code is never run to measure it: a batch made on the main thread at the end
of a run could open files a later fork would inherit (h5py), draw from the random generators,
or behave unlike its workers (``get_worker_info()``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

#: Reading at these window counts (1-4, then powers of two): a bounded number of reads in any run.
DENSE_READS = 4


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _schedstat(path: str) -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting for one) from a ``schedstat`` file, or None where there is none."""
    fields = (_read(path) or b"").split()
    try:
        return int(fields[0]), int(fields[1])
    except (ValueError, IndexError):
        return None


def _idle_ns() -> int | None:
    """The machine's idle CPU time (all its cores, ``/proc/stat``'s idle and iowait), or None off Linux."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        return int((int(fields[4]) + int(fields[5])) * 1e9 / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


#: The name torch's DataLoader gives its worker processes (``_worker_loop``); other children are not read.
WORKER_NAME = b"pt_data_worker"


def _worker_pids(tid: int) -> list[int]:
    """The DataLoader workers this thread started (Linux's ``children`` of the thread; those torch named, or all of
    them under a torch that names none).  Read from /proc, so nothing is reaped: ``multiprocessing.active_children``
    would wait for ended ones, which the DataLoader's own failure check then could not see."""
    pids = [int(p) for p in (_read(f"/proc/self/task/{tid}/children") or b"").split()]
    named = [p for p in pids if (_read(f"/proc/{p}/comm") or b"").strip() == WORKER_NAME]
    return named or pids


def _children_cpu_ns() -> int:
    """CPU time of the children already ended and reaped (a non-persistent loader's workers at each epoch's end)."""
    try:
        import resource  # POSIX only
    except ImportError:
        return 0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return int((ru.ru_utime + ru.ru_stime) * 1e9)


@dataclass
class Reading:
    """One reading at a window's end: clocks, and the steps and ``period`` time the windows so far held."""

    wall_ns: int
    process_ns: int
    thread: int
    thread_sched: tuple[int, int] | None
    workers: dict[int, tuple[int, int, int]]
    reaped_ns: int
    idle_ns: int | None
    steps: int
    period_ms: float


def _worker(pid: int) -> tuple[int, int, int] | None:
    """A worker's CPU time in all its threads (the feeder thread pickles its batches), and its main thread's time on
    a CPU and queued for one (the thread that makes the batches, or waits for the next index)."""
    main = _schedstat(f"/proc/{pid}/schedstat")
    try:
        tids = os.listdir(f"/proc/{pid}/task") if main is not None else []
    except OSError:  # it ended between the two reads
        return None
    if main is None:
        return None
    threads = (_schedstat(f"/proc/{pid}/task/{t}/schedstat") for t in tids)
    total = sum(t[0] for t in threads if t is not None)
    return max(total, main[0]), main[0], main[1]


def read(steps: int, period_ms: float) -> Reading:
    tid = threading.get_native_id()
    workers = {}
    for pid in _worker_pids(tid):
        w = _worker(pid)
        if w is not None:
            workers[pid] = w
    return Reading(time.perf_counter_ns(), time.process_time_ns(), tid, _schedstat(f"/proc/self/task/{tid}/schedstat"),
                   workers, _children_cpu_ns(), _idle_ns(), steps, period_ms)


#: A span between two readings is used only if its wall time is at most this multiple of the ``period`` time its
#: steps took: longer, and it holds time that was no step's (a validation, the run's end), whose CPU says nothing
#: of the loading.  Of the spans that qualify, the one with the most steps.
SPAN_SLACK = 1.25
#: ... and only with at least this many steps.
MIN_SPAN_STEPS = 10


@dataclass
class CpuUse:
    """The readings of one run, and what they say over the longest span of steady steps."""

    readings: list[Reading] = field(default_factory=list)
    failed: str | None = None
    windows: int = 0
    steps: int = 0
    period_ms: float = 0.0

    def add_window(self, steps: int, period_ms: float) -> None:
        """A window resolved with ``steps`` steps and ``period_ms`` of ``period`` in all: read at a few of them."""
        self.windows += 1
        self.steps += steps
        self.period_ms += period_ms
        n = self.windows
        if self.failed is None and (n <= DENSE_READS or n & (n - 1) == 0):
            try:
                self.readings.append(read(self.steps, self.period_ms))
            except Exception as err:  # noqa: BLE001 - a signal lost, never the step: the advice says so
                self.failed = f"{type(err).__name__}: {err}"

    def summary(self) -> dict[str, Any] | None:
        """The CPU shares over the longest usable span (None: no such span, e.g. fewer than two readings)."""
        span = self._span()
        if span is None:
            return None
        first, last, used = span
        wall = last.wall_ns - first.wall_ns
        out: dict[str, Any] = {
            "steps": last.steps - first.steps, "wall_ms": wall / 1e6,
            "process_cores": (last.process_ns - first.process_ns) / wall,
        }
        if first.thread_sched is not None and last.thread_sched is not None:
            busy, queued = (b - a for a, b in zip(first.thread_sched, last.thread_sched))
            out["thread"] = _shares(busy, queued, wall)
        out.update(_workers(used, wall))
        if first.idle_ns is not None and last.idle_ns is not None:
            out["idle_cores"] = (last.idle_ns - first.idle_ns) / wall  # any process's idle: others use cores too
        return out

    def _span(self) -> tuple[Reading, Reading, list[Reading]] | None:
        """The two readings on the same thread, the most steps apart, whose span was steps (no pause within)."""
        best = None
        rs = self.readings
        for i, first in enumerate(rs):
            for j in range(len(rs) - 1, i, -1):
                last = rs[j]
                steps, period_ms = last.steps - first.steps, last.period_ms - first.period_ms
                wall_ms = (last.wall_ns - first.wall_ns) / 1e6
                if last.thread == first.thread and steps >= MIN_SPAN_STEPS and 0 < wall_ms <= SPAN_SLACK * period_ms:
                    if best is None or steps > best[0]:
                        best = (steps, i, j)
                    break  # the latest j for this i is its longest
        if best is None:
            return None
        _, i, j = best
        return rs[i], rs[j], rs[i: j + 1]


def _shares(busy_ns: int, queued_ns: int, wall_ns: int) -> dict[str, float]:
    """A thread's (or the workers' together) wall time split: on a CPU, waiting for one, and the rest asleep."""
    busy, queued = busy_ns / wall_ns, queued_ns / wall_ns
    return {"busy": busy, "queued": queued, "asleep": max(0.0, 1.0 - busy - queued)}


def _workers(readings: list[Reading], wall_ns: int) -> dict[str, Any]:
    """The workers' CPU over the span (live and reaped), and their time split from the workers seen at both ends
    of each pair of consecutive readings (workers restart every epoch unless persistent)."""
    first, last = readings[0], readings[-1]
    if not any(r.workers for r in readings):  # none running, or none readable (off Linux): nothing to say
        return {"workers_seen": 0}
    live = sum(w[0] for w in last.workers.values()) - sum(w[0] for w in first.workers.values())
    cores = (live + last.reaped_ns - first.reaped_ns) / wall_ns
    busy = queued = seen = 0
    for a, b in zip(readings, readings[1:]):
        for pid in a.workers.keys() & b.workers.keys():
            busy += b.workers[pid][1] - a.workers[pid][1]
            queued += b.workers[pid][2] - a.workers[pid][2]
            seen += b.wall_ns - a.wall_ns
    out: dict[str, Any] = {"worker_cores": max(0.0, cores), "workers_seen": max(len(r.workers) for r in readings)}
    if seen:
        out["worker"] = _shares(busy, queued, seen)
    return out
