"""Every rank's phases side by side: a small exchange through the job's own store, never waited on.

Each rank times its own steps with its own core.  When a rank writes a window, it
puts the window's per-phase sums and counts (about 30 bytes a phase) in an outbox.
Every ``window`` ended steps (the same step on every rank, since the ranks step
together) it hands the outbox to a thread of its own, which appends it to one key of
the c10d store that ``init_process_group`` already set up (``phase_timer/<n>/<k>`` for
the k-th exchange) and bumps that key's counter: two small requests a window, however
many ranks there are.  Rank zero's thread reads the counter, fetches every rank's
report for that exchange in one request when they are all in, writes them, and
deletes the keys.

* No process group of our own: creating one builds a full mesh of connections
  (O(N²) over the job, N−1 sockets a rank), which large jobs avoid.  Set-up is one
  thread a rank, whatever N is; the requests go over the store connection the rank
  already has.
* The training thread only puts on a queue and reads what arrived: no barrier, no
  collective, no device work, no host-device sync.
* A window is written (``phase_time_ranks/<phase>_ms/{min,median,max,slowest_rank}``)
  once every rank has reported it or has moved past it.  A rank silent for
  ``STALE_EXCHANGES`` exchanges and ``STALE_S`` seconds is taken as gone (one
  warning): the others go on.
* Every rank must make its timers alike (the same ``enabled``, in the same order): the
  exchange's keys are named by the timer's number in its process.  Keys a rank still
  running appends after rank zero has ended are left in the store (a few hundred bytes a
  window); the store goes away with the job.
* ``finish()`` sends the last, partial window and waits a bounded time for the reports
  still missing.  This is a wait on the other ranks, not on the device, and it happens
  only at the end; after an exception nothing is sent and nothing is waited for.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from phase_timer._env import warn

log = logging.getLogger(__name__)

#: A rank silent this many exchanges and ``STALE_S`` seconds is taken as gone (it died, or stopped).
STALE_EXCHANGES = 8
STALE_S = 30.0
#: A frame: the sending rank, whether it is its final report, and the JSON's length.
_FRAME = struct.Struct("<IBI")
#: One exchange namespace per timer of this process: every rank creates its timers in the same order.
_INSTANCES = itertools.count()


@dataclass
class RankWindow:
    """One window across ranks: each rank's mean ms per phase (only ranks that reported)."""

    key: int
    step: int
    means: dict[str, dict[int, float]]
    ranks: int
    #: Each rank's peak allocated MB as of this window (CUDA ranks that read memory only).
    peak_mb: dict[int, float] = field(default_factory=dict)
    #: Each rank's counts over this window (``throughput.split_counts``), where its batches were counted.
    counts: dict[int, dict[str, float]] = field(default_factory=dict)

    def stats(self, phase: str) -> dict[str, float]:
        by_rank = self.means[phase]
        values = list(by_rank.values())
        slowest = max(by_rank, key=lambda r: (by_rank[r], -r))  # ties: the lowest rank
        return {"min": min(values), "median": statistics.median(values), "max": max(values), "slowest_rank": float(slowest)}


@dataclass
class RankTotals:
    """Run-wide sums per rank and phase, for the end-of-fit table (rank zero)."""

    world_size: int
    sums: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # rank -> phase -> [sum, count]
    steps: dict[int, int] = field(default_factory=dict)
    #: Each rank's memory as of its latest report: peak_allocated_mb, peak_reserved_mb, device_total_mb,
    #: alloc_retries (CUDA ranks that read memory only).
    memory: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Each rank's counts over the run (samples, tokens, period_ms, steps), for the job's throughput.
    counts: dict[int, dict[str, float]] = field(default_factory=dict)

    def add_counts(self, rank: int, counts: dict[str, float]) -> None:
        mine = self.counts.setdefault(rank, {})
        for k, v in counts.items():
            mine[k] = mine.get(k, 0.0) + float(v)

    def add(self, rank: int, steps: int, sums: dict[str, list[float]]) -> None:
        """One window of ``rank``: ``sums`` is ``{phase: [sum_ms, count]}``."""
        self.steps[rank] = self.steps.get(rank, 0) + steps
        mine = self.sums.setdefault(rank, {})
        for phase, (total, count) in sums.items():
            acc = mine.setdefault(phase, [0.0, 0])
            acc[0] += total
            acc[1] += count

    def mean(self, rank: int, phase: str) -> float | None:
        acc = self.sums.get(rank, {}).get(phase)
        return acc[0] / acc[1] if acc and acc[1] else None


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode(rank: int, windows: list[bytes], *, final: bool = False) -> bytes:
    """One rank's report as a frame: its rank, the final flag, then JSON ``[window, ...]``.

    ``windows`` are already JSON-encoded (each once, when it was added).
    """
    data = b"[" + b",".join(windows) + b"]"
    return _FRAME.pack(rank, int(final), len(data)) + data


def decode(buf: bytes, offset: int = 0) -> tuple[list[tuple[int, bool, list[Any]]], int]:
    """The whole frames in ``buf`` from ``offset``: ``[(rank, final, windows)]`` and where they end."""
    out = []
    while offset + _FRAME.size <= len(buf):
        rank, final, n = _FRAME.unpack_from(buf, offset)
        start = offset + _FRAME.size
        if start + n > len(buf):
            break  # a frame still being appended
        out.append((rank, bool(final), json.loads(buf[start : start + n])))
        offset = start + n
    return out, offset


class RankExchange:
    """The exchange of window reports to rank zero through the job's store (see the module's text)."""

    def __init__(self, store: Any, rank: int, world_size: int, namespace: str) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.totals = RankTotals(world_size) if rank == 0 else None
        self.broken = False
        self.finished: set[int] = set()  # ranks whose final report arrived (rank zero)
        self.gone: set[int] = set()  # ranks taken as gone (rank zero's thread adds them)
        self._gone_said: set[int] = set()  # ... of which the training thread has warned
        self._outbox: list[bytes] = []  # windows not sent yet, JSON-encoded
        self._sent = 0  # exchanges this rank has made
        self._reports: dict[int, dict[int, list[Any]]] = {}  # key -> rank -> [key, step, steps, sums]
        self._latest: dict[int, int] = {}  # rank -> newest key it reported
        self._written = -1  # newest key written
        # The exchange's thread: what to do, and (rank zero) what arrived.
        self._todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[tuple[int, bool, list[Any]]] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._sent_event = threading.Event()  # set when the newest request is done
        self._sent_event.set()
        # Rank zero's thread only:
        self._next = 0  # the oldest exchange not fully read
        self._touched = -1  # the newest exchange read
        self._read: dict[int, int] = {}  # exchange -> bytes of it already read
        self._counted: dict[int, int] = {}  # exchange -> reports it holds
        self._frames: dict[int, int] = {}  # exchange -> reports read from it (one may be in before its count)
        self._uncounted: set[int] = set()  # closed exchanges with a report read before its count was bumped
        self._heard: dict[int, tuple[int, float]] = {}  # rank -> (newest exchange it was heard in, when)
        self._final_at: dict[int, int] = {}  # rank -> the exchange of its final report
        self._in: dict[int, set[int]] = {}  # exchange -> the ranks read in it
        self._want: dict[int, int] = {}  # rank -> the exchange of its next frame to pass on
        self._held: dict[int, dict[int, tuple[bool, list[Any]]]] = {}  # rank -> frames that came early
        self._gone_from: dict[int, int] = {}  # gone rank -> the first exchange closed without it
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"phase-timer-ranks-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls) -> RankExchange | None:
        """The exchange of this process's default group, or None when not distributed.

        Not a collective, and no new connection: each rank uses the store connection
        ``init_process_group`` gave it.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception as err:  # noqa: BLE001 - time this rank alone
            msg = f"phase-timer: no store for the exchange between ranks ({type(err).__name__}: {err}); each rank is timed alone"
            warn(log, msg, 2)
            return None
        return cls(store, dist.get_rank(), dist.get_world_size(), f"phase_timer/{next(_INSTANCES)}")

    # -- the training thread, once a window -------------------------------------------
    def add(self, key: int, last_step: int, steps: int, values: dict[str, list[float]], *,
            memory: dict[str, float] | None = None, counts: dict[str, float] | None = None) -> None:
        """A window this rank has written (its ms per phase; its memory, if read: ``peak_allocated_mb``,
        ``peak_reserved_mb``, ``device_total_mb``, ``alloc_retries``); it goes out with the next exchange.
        Rank zero keeps its own.
        """
        if self.broken:
            return  # the exchange stopped: keep nothing (memory stays flat)
        report: list[Any] = [key, last_step, steps, {p: [sum(vs), len(vs)] for p, vs in values.items()}]
        extra = dict(memory or {})
        if counts:
            extra["counts"] = counts  # the window's samples/tokens and their period: the job's throughput
        if extra:
            report.append(extra)
        if self.rank == 0:
            self._receive(0, report)
        else:
            self._outbox.append(_json(report))

    def exchange(self) -> list[RankWindow]:
        """Read the reports that have arrived, hand this rank's to the thread; never waits."""
        self._check_error()
        if self.broken:
            return []
        out = self._arrived(final=False)
        self._post(final=False)
        return out

    def finish(self, timeout_s: float, *, interrupted: bool = False) -> list[RankWindow]:
        """Send the last windows, wait up to ``timeout_s`` for the reports still missing, write the rest.

        A wait on the other ranks (not on the device), at the end of training only.
        ``interrupted`` (an exception): send nothing more and wait for nothing; what has
        arrived is written.
        """
        out: list[RankWindow] = []
        deadline = time.monotonic() + timeout_s
        try:
            self._check_error()
            if not self.broken and not interrupted:
                self._post(final=True)
                if self.rank == 0:
                    out = self._await_finals(deadline, timeout_s)
                else:  # the final report is out (or the deadline passed) before this returns: the process
                    # may go on to a blocking store request of its own, which would queue our send behind it
                    self._sent_event.wait(timeout_s)
                self._check_error()
            if self.rank == 0:
                out += self._arrived(final=False)
                self.finished.add(0)
                late = sorted(set(range(self.world_size)) - self.finished - self.gone)
                if late and not interrupted and not self.broken:
                    self._warn(f"rank(s) {late} had not finished when rank 0 did: their last windows are missing")
                out += self._ready(final=True)
                if not self.broken:
                    self._ask("forget")  # delete the keys of exchanges never completed
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            self._give_up(f"{type(err).__name__}: {err}")
        self._todo.put(("stop",))
        # A thread still inside a store request when the interpreter exits aborts the
        # process (SIGABRT as it is torn down): let it finish, a bounded time.
        self._thread.join(1.0 if interrupted else max(1.0, deadline - time.monotonic()))
        return out

    def _check_error(self) -> None:
        if self._error is not None:
            self._give_up(f"{type(self._error).__name__}: {self._error}")

    # -- the training thread: internals ------------------------------------------------
    def _post(self, *, final: bool) -> None:
        """This rank's part of the next exchange, to the thread (rank zero: read up to it)."""
        k = self._sent
        self._sent += 1
        if self.rank == 0:
            if self._sent_event.is_set():  # else the read still running is followed by the next one
                self._sent_event = self._ask("read", k, final)
            return
        batch, self._outbox = self._outbox, []
        self._sent_event = self._ask("send", k, encode(self.rank, batch, final=final))

    def _ask(self, *item: Any) -> threading.Event:
        """A request to the exchange's thread, and an event set once it is done (or failed)."""
        done = threading.Event()
        self._todo.put((*item, done))
        return done

    def _arrived(self, *, final: bool) -> list[RankWindow]:
        """What rank zero's thread has read, into the windows (rank zero only)."""
        if self.rank != 0:
            return []
        for r in sorted(self.gone - self._gone_said):  # warnings belong on the training thread
            self._gone_said.add(r)
            self._warn(f"rank {r} has not reported for {STALE_EXCHANGES} exchanges: taken as gone, the others go on")
        while True:
            try:
                rank, is_final, windows = self._inbox.get_nowait()
            except queue.Empty:
                break
            for window in windows:
                self._receive(rank, window)
            if is_final:
                self.finished.add(rank)
        return self._ready(final=final)

    def _await_finals(self, deadline: float, timeout_s: float) -> list[RankWindow]:
        """Rank zero at the end: read until every rank's final report is in, or the deadline passed."""
        out: list[RankWindow] = []
        while True:
            out += self._arrived(final=False)
            missing = set(range(1, self.world_size)) - self.finished - self.gone
            left = deadline - time.monotonic()
            if not missing or self.broken or self._error is not None or left <= 0:
                break
            # End of training only: waiting on the other ranks (not on the device).  The read
            # asked last must be done before the next is asked, and reads come 10 ms apart.
            self._sent_event.wait(left)
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
            self._sent_event = self._ask("read", self._sent - 1, True)
        if missing and not self.broken and self._error is None:
            self._warn(f"rank(s) {sorted(missing)} sent no final report within {timeout_s:g} s "
                       "(did the ranks run different numbers of steps?)")
        return out

    def _receive(self, rank: int, report: list[Any]) -> None:
        key = int(report[0])
        if key <= self._written:
            return  # too late: that window is already written without this rank
        self._reports.setdefault(key, {})[rank] = report
        self._latest[rank] = max(self._latest.get(rank, -1), key)

    def _ready(self, *, final: bool) -> list[RankWindow]:
        """Windows every rank has reported or moved past (all of them when ``final``)."""
        if self.rank != 0:
            return []
        waiting = [r for r in range(self.world_size) if r not in self.gone and r not in self.finished]
        horizon = min((self._latest.get(r, -1) for r in waiting), default=max(self._reports, default=-1))
        out = []
        for key in sorted(self._reports):
            if not final and key > horizon:
                break
            reports = self._reports.pop(key)
            self._written = key
            means: dict[str, dict[int, float]] = {}
            peaks: dict[int, float] = {}
            counts: dict[int, dict[str, float]] = {}
            for rank, (_, _, steps, sums, *extra) in reports.items():
                assert self.totals is not None
                self.totals.add(rank, steps, sums)
                for phase, (s, c) in sums.items():
                    if c:
                        means.setdefault(phase, {})[rank] = s / c
                peak = dict(extra[0]) if extra and isinstance(extra[0], dict) else {}
                mine = peak.pop("counts", None)
                if isinstance(mine, dict):
                    counts[rank] = mine
                    self.totals.add_counts(rank, mine)
                if isinstance(peak.get("peak_allocated_mb"), (int, float)):
                    self.totals.memory[rank] = peak
                    peaks[rank] = float(peak["peak_allocated_mb"])
            step = max(int(r[1]) for r in reports.values())
            out.append(RankWindow(key, step, means, len(reports), peaks, counts))
        return out

    # -- the exchange's own thread -----------------------------------------------------
    def _run(self) -> None:
        item: tuple[Any, ...] = ()
        try:
            while True:
                item = self._todo.get()
                if item[0] == "stop":
                    return
                if item[0] == "send":  # two small requests, whatever the number of ranks
                    _, k, frame, _ = item
                    self.store.append(f"{self.namespace}/{k}", frame)
                    self.store.add(f"{self.namespace}/{k}/n", 1)
                elif item[0] == "read":
                    self._read_up_to(item[1], beyond=item[2])
                elif item[0] == "forget":
                    for k in [*range(self._next, max(self._sent, self._touched + 1)), *self._uncounted]:
                        self._forget(k)
                item[-1].set()
        except Exception as err:  # noqa: BLE001 - the training thread gives up at its next exchange
            self._error = err
            while item[0] != "stop":  # nothing more is done, and nobody waits for it
                item[-1].set()
                item = self._todo.get()

    def _read_up_to(self, last: int, *, beyond: bool = False) -> None:
        """Rank zero: read every exchange from the oldest not complete to ``last``; delete what is complete.

        ``beyond`` (at the end): also the exchanges after ``last`` that exist, those of
        ranks that ran more steps than rank zero.
        """
        ns, store = self.namespace, self.store
        k = self._next - 1
        while True:
            k += 1
            if k > last and not (beyond and store.check([f"{ns}/{k}/n"])):
                break
            self._touched = max(self._touched, k)
            count = int(store.add(f"{ns}/{k}/n", 0))
            if count > self._counted.get(k, 0):
                frames, self._read[k] = decode(store.get(f"{ns}/{k}"), self._read.get(k, 0))
                self._counted[k] = count
                self._frames[k] = self._frames.get(k, 0) + len(frames)
                for frame in frames:
                    self._take(k, *frame)
            if k == self._next and self._in.get(k, set()) >= self._expected(k):
                self._close(k)
        for k in [k for k in self._uncounted if store.check([f"{ns}/{k}/n"])]:  # its late count made it again
            self._uncounted.discard(k)
            self._forget(k)
        self._mark_gone(last)

    def _take(self, k: int, rank: int, final: bool, windows: list[Any]) -> None:
        """A rank's frame of exchange ``k``, passed on in the order the rank sent its frames.

        A rank appends to exchange k before k+1, but a read of k can come before that
        append and the read of k+1 after it: a frame that comes early waits for the ones before.
        """
        self._in.setdefault(k, set()).add(rank)
        if rank in self.gone:  # it was only slow: it counts again (a new set: the training thread reads it)
            self.gone = self.gone - {rank}
            for old in range(self._gone_from.pop(rank, k), self._next):  # its late appends made these again
                self._forget(old)
        held = self._held.setdefault(rank, {})
        held[k] = (final, windows)
        while self._want.get(rank, 0) in held:
            j = self._want.get(rank, 0)
            is_final, ws = held.pop(j)
            self._want[rank] = j + 1
            self._heard[rank] = (j, time.monotonic())
            if is_final:
                self._final_at[rank] = j
            self._inbox.put((rank, is_final, ws))

    def _close(self, k: int) -> None:
        """Exchange ``k`` holds every report it will get: delete it; gone ranks' frames of it are given up."""
        for r in self.gone:
            if r not in self._in[k]:
                self._want[r] = max(self._want.get(r, 0), k + 1)
                self._gone_from.setdefault(r, k)
                for j in [j for j in self._held.get(r, {}) if j <= k]:
                    del self._held[r][j]
        self._forget(k)
        # A rank appends its report, then bumps the count: a report read before its count means a bump still
        # to come, which makes the counter key again after this delete (deleted when seen, or at the end).
        if self._frames.pop(k, 0) > self._counted.get(k, 0):
            self._uncounted.add(k)
        self._read.pop(k, None)
        self._counted.pop(k, None)
        self._in.pop(k, None)
        self._next = k + 1

    def _forget(self, k: int) -> None:
        self.store.delete_key(f"{self.namespace}/{k}")
        self.store.delete_key(f"{self.namespace}/{k}/n")

    def _expected(self, k: int) -> set[int]:
        """The ranks whose report exchange ``k`` will hold: every other rank not finished before it, and not gone."""
        return {r for r in range(1, self.world_size) if self._final_at.get(r, k) >= k and r not in self.gone}

    def _mark_gone(self, now: int) -> None:
        """Ranks silent for STALE_EXCHANGES exchanges and STALE_S seconds (the training thread warns)."""
        clock = time.monotonic()
        for r in range(1, self.world_size):
            if r in self.gone or r in self._final_at:
                continue
            k, when = self._heard.get(r, (-1, self._started))
            if now - k > STALE_EXCHANGES and clock - when > STALE_S:
                self.gone = self.gone | {r}  # a new set: the training thread reads it

    def _give_up(self, why: str) -> None:
        if self.broken:
            return
        self.broken = True
        self._todo.put(("stop",))
        self._warn(f"the exchange between ranks stopped ({why}); each rank's own timing goes on")

    def _warn(self, why: str) -> None:
        msg = f"phase-timer (rank {self.rank}): {why}"
        warn(log, msg, 3)
