"""Every rank's phases side by side: a small exchange at window boundaries, never waited on.

Each rank times its own steps with its own core.  When a rank writes a window, it
puts the window's per-phase sums and counts in an outbox.  Every ``window`` ended
steps (the same step on every rank, since the ranks step together) it sends the
outbox to rank zero with an asynchronous ``gather`` on a gloo group of our own.
The gather starts at one boundary and is read at a later one. ``is_completed()``
never blocks, and the training step never waits for another rank.

* The group is separate, so our collectives never interleave with the run's own
  (NCCL or gloo) in a way the ranks could disagree on.  Gloo works on host
  tensors, so no device work and no host-device sync is involved.
* Rank zero gets one report per rank for each window.  A window is written
  (``phase_time_ranks/<phase>_ms/{min,median,max,slowest_rank}``) once every rank
  has reported it or has moved past it.
* ``finish()`` sends the last, partial window and waits a bounded time for the
  reports still in flight.  This is a wait on the other ranks, not on the device,
  and it happens only at the end.  A rank that never reports (it ran fewer steps
  or died) costs that timeout and a warning; nothing hangs.
"""

from __future__ import annotations

import json
import logging
import statistics
import struct
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Bytes per report.  A window is ~30 bytes per phase, so this holds dozens of windows.
CAPACITY = 16384
#: Reports that may be in flight before the exchange is given up (normally 1 or 2).
MAX_IN_FLIGHT = 16
_HEADER = struct.Struct("<I")

@dataclass
class RankWindow:
    """One window across ranks: each rank's mean ms per phase (only ranks that reported)."""

    key: int
    step: int
    means: dict[str, dict[int, float]]
    ranks: int

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


def encode(windows: list[bytes], *, final: bool = False) -> torch.Tensor:
    """A report as a ``CAPACITY``-byte tensor: length, then JSON ``{"final": .., "windows": [..]}``.

    ``windows`` are already JSON-encoded (each once, when it was added).
    """
    data = b'{"final":' + (b"true" if final else b"false") + b',"windows":[' + b",".join(windows) + b"]}"
    out = torch.zeros(CAPACITY, dtype=torch.uint8)
    out[: _HEADER.size] = torch.frombuffer(bytearray(_HEADER.pack(len(data))), dtype=torch.uint8)
    if data:
        out[_HEADER.size : _HEADER.size + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode(buf: torch.Tensor) -> dict[str, Any]:
    raw = buf.numpy().tobytes()
    (n,) = _HEADER.unpack_from(raw)
    return json.loads(raw[_HEADER.size : _HEADER.size + n]) if n else {"final": False, "windows": []}


#: Bytes of a report besides its windows (header, braces, the final flag, commas).
_OVERHEAD = _HEADER.size + 64


class RankExchange:
    """The asynchronous gather of window reports to rank zero (see the module's text)."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.totals = RankTotals(world_size) if rank == 0 else None
        self.broken = False
        self._outbox: list[bytes] = []  # windows not sent yet, JSON-encoded
        self.finished: set[int] = set()  # ranks whose final report arrived (rank zero)
        self._in_flight: list[tuple[Any, torch.Tensor, list[torch.Tensor] | None]] = []
        self._reports: dict[int, dict[int, list[Any]]] = {}  # key -> rank -> [key, step, steps, sums]
        self._latest: dict[int, int] = {}  # rank -> newest key it reported
        self._written = -1  # newest key written

    @classmethod
    def create(cls) -> RankExchange | None:
        """The exchange of this process's default group, or None when not distributed.

        A collective (``new_group``): every rank must call it at the same point.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        try:
            group = dist.new_group(backend="gloo")
        except Exception as err:  # noqa: BLE001 - e.g. a build without gloo: time this rank alone
            msg = f"phase-timer: no gloo group for the exchange between ranks ({type(err).__name__}: {err}); each rank is timed alone"
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return None
        return cls(group, dist.get_rank(), dist.get_world_size())

    # -- the training thread, once a window -------------------------------------------
    def add(self, key: int, last_step: int, steps: int, values: dict[str, list[float]]) -> None:
        """A window this rank has written (its ms per phase); it goes out with the next report.

        Rank zero keeps its own.
        """
        if self.broken:
            return  # the exchange stopped: keep nothing (memory stays flat)
        report = [key, last_step, steps, {p: [sum(vs), len(vs)] for p, vs in values.items()}]
        if self.rank == 0:
            self._receive(0, report)
        else:
            self._outbox.append(_json(report))

    def exchange(self) -> list[RankWindow]:
        """Read the reports that have arrived, send a new one; never waits."""
        if self.broken:
            return []
        try:
            out = self._collect(block_until=None)
            if len(self._in_flight) >= MAX_IN_FLIGHT:
                self._give_up(f"{MAX_IN_FLIGHT} reports in flight: another rank stopped reporting")
                return out
            self._send(final=False)
            return out
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            self._give_up(f"{type(err).__name__}: {err}")
            return []

    def finish(self, timeout_s: float, *, interrupted: bool = False) -> list[RankWindow]:
        """Send the last windows, wait up to ``timeout_s`` for the reports in flight, write the rest.

        A wait on the other ranks (not on the device), at the end of training only.
        ``interrupted`` (an exception): send nothing more and wait for nothing, since a
        rank that raised must not leave a collective behind that its peers, stuck in the
        run's own collectives, can never answer; what has arrived is written.
        """
        out: list[RankWindow] = []
        try:
            if not self.broken and not interrupted:
                self._send(final=True)
                out = self._collect(block_until=time.monotonic() + timeout_s)
                if self._in_flight and not self.broken:
                    self._give_up(
                        f"{len(self._in_flight)} report(s) did not arrive within {timeout_s:g} s "
                        "(did the ranks run different numbers of steps?)"
                    )
            elif not self.broken:
                out = self._collect(block_until=None)
            if self.rank == 0:
                self.finished.add(0)
                late = sorted(set(range(self.world_size)) - self.finished)
                if late and not interrupted:
                    self._warn(f"rank(s) {late} had not finished when rank 0 did: their last windows are missing")
            out += self._ready(final=True)
        except Exception as err:  # noqa: BLE001
            self._give_up(f"{type(err).__name__}: {err}")
        return out

    # -- internals ----------------------------------------------------------------------
    def _send(self, *, final: bool) -> None:
        import torch.distributed as dist

        size, n = _OVERHEAD, 0
        for window in self._outbox:
            if size + len(window) + 1 > CAPACITY:
                break
            size += len(window) + 1
            n += 1
        batch, self._outbox = self._outbox[:n], self._outbox[n:]
        if final and self._outbox:
            self._warn(f"{len(self._outbox)} window(s) of rank {self.rank} did not fit the last report")
            self._outbox = []
        payload = encode(batch, final=final)
        gather_list = [torch.empty_like(payload) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            work = dist.gather(payload, gather_list, dst=dist.get_global_rank(self.group, 0), group=self.group, async_op=True)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            self._give_up(f"{type(err).__name__}: {err}")
            return
        self._in_flight.append((work, payload, gather_list))

    def _collect(self, *, block_until: float | None) -> list[RankWindow]:
        """Reports whose gather has completed, oldest first; waits only until ``block_until``."""
        while self._in_flight:
            work, _, gather_list = self._in_flight[0]
            try:
                if not work.is_completed():
                    if block_until is None or time.monotonic() >= block_until:
                        break
                    time.sleep(0.001)  # end of training only: waiting on the other ranks
                    continue
                work.wait()  # completed: returns at once, raises if the gather failed
            except Exception as err:  # noqa: BLE001
                self._give_up(f"{type(err).__name__}: {err}")
                break
            self._in_flight.pop(0)
            if gather_list is not None:
                for rank, buf in enumerate(gather_list):
                    report = decode(buf)
                    for window in report["windows"]:
                        self._receive(rank, window)
                    if report["final"]:
                        self.finished.add(rank)
        return self._ready(final=False)

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
        horizon = min(self._latest.get(r, -1) for r in range(self.world_size))
        out = []
        for key in sorted(self._reports):
            if not final and key > horizon:
                break
            reports = self._reports.pop(key)
            self._written = key
            means: dict[str, dict[int, float]] = {}
            for rank, (_, _, steps, sums) in reports.items():
                assert self.totals is not None
                self.totals.add(rank, steps, sums)
                for phase, (s, c) in sums.items():
                    if c:
                        means.setdefault(phase, {})[rank] = s / c
            step = max(int(r[1]) for r in reports.values())
            out.append(RankWindow(key, step, means, len(reports)))
        return out

    def _give_up(self, why: str) -> None:
        if self.broken:
            return
        self.broken = True
        self._in_flight = []  # buffers of an abandoned gather are simply dropped
        self._warn(f"the exchange between ranks stopped ({why}); each rank's own timing goes on")

    def _warn(self, why: str) -> None:
        msg = f"phase-timer (rank {self.rank}): {why}"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
