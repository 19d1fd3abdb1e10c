"""Every rank's phases side by side: a small exchange through the job's own store, never waited on.

Each rank times its own steps with its own core.  When a rank writes a window, it puts the window's
per-phase sums and counts (about 30 bytes a phase) in an outbox.  Every ``window`` ended steps (the
same step on every rank, since the ranks step together) it hands the outbox, with its run totals so
far, to a thread of its own, which appends them to its group's key of the c10d store that
``init_process_group`` already set up and bumps that key's counter: two small requests a window,
however many ranks there are.

The ranks report through a tree of groups of ``FAN_IN`` (64; :mod:`phase_timer.distributed.rank_tree`).  The leader
of a group reads its children's reports of each exchange in one request (:mod:`phase_timer.distributed.rank_reader`),
merges them per window into one summary whose size does not grow with the ranks under it
(:mod:`phase_timer.distributed.rank_summary`: min, median, max and slowest rank per phase, the memory peaks, the
job's samples and tokens a second), and sends it up to its parent's key the same way
(:mod:`phase_timer.distributed.rank_node`).  Rank zero leads only the root: it reads at most ``FAN_IN`` summaries a
window, whether the job has 64 ranks or 16k; no leader reads more.  Up to 64 ranks the tree is one
node, rank zero's, which reads every rank as before.

* No process group of our own: creating one builds a full mesh of connections (O(N²) over the job,
  N−1 sockets a rank), which large jobs avoid.  Set-up is one thread a rank, whatever N is; the
  requests go over the store connection the rank already has.
* The training thread only puts on a queue and reads what arrived: no barrier, no collective, no
  device work, no host-device sync.  A leader's merging is on its exchange thread.
* A window is written (``phase_time_ranks/<phase>_ms/{min,median,max,slowest_rank}``) once every rank
  has reported it or has moved past it.  The median across ranks is exact up to 64 ranks, within
  0.5% beyond (a 1% histogram).  A rank silent for ``STALE_EXCHANGES`` exchanges and ``STALE_S``
  seconds is taken as gone (one warning on rank zero): the others go on.  A group whose leader is
  gone, or finished before the group, is read by the leader above it.
* Every rank must make its timers alike (the same ``enabled``, in the same order): the exchange's
  keys are named by the timer's number in its process.  Keys a rank still running appends after
  its group's reader has ended are left in the store (a few hundred bytes a window); the store goes
  away with the job.
* ``finish()`` sends the last, partial window, and a leader waits a bounded time for its group's last
  reports (a level-L leader ``L / depth`` of ``rank_timeout_s``, so that what it sends up reaches rank
  zero within rank zero's own wait).  This is a wait on the other ranks, not on the device, and it
  happens only at the end; after an exception nothing is sent and nothing is waited for.  Rank zero
  then reads every rank's run totals (one key a group of 64) for the per-rank table.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from phase_timer._env import warn
from phase_timer.distributed.rank_node import NodeReader, adopted_key, leaf_body, parse_table, table_bytes, table_key
from phase_timer.distributed.rank_reader import STALE_EXCHANGES, STALE_S, decode, encode  # noqa: F401 - re-exported
from phase_timer.distributed.rank_summary import Spread, Summary
from phase_timer.distributed.rank_tree import FAN_IN, Tree

log = logging.getLogger(__name__)

#: One exchange namespace per timer of this process: every rank creates its timers in the same order.
_INSTANCES = itertools.count()
#: Ranks' run totals fetched per request at the end (one key a group).
_TABLES_PER_REQUEST = 256


@dataclass
class RankWindow:
    """One window across ranks: each phase's spread of per-rank means (only ranks that reported)."""

    key: int
    step: int
    phases: dict[str, Spread]
    ranks: int
    #: Peak allocated MB across the ranks that read memory (CUDA ranks only), as of this window.
    peak_mb: Spread | None = None
    #: The job's ``samples_per_s`` / ``tokens_per_s`` over this window: each rank's rate, summed.
    job: dict[str, float] = field(default_factory=dict)

    def stats(self, phase: str) -> dict[str, float]:
        """``{min, median, max, slowest_rank}`` of a phase (a tie names the lowest rank)."""
        return self.phases[phase].stats()

    @classmethod
    def of(cls, s: Summary) -> RankWindow:
        return cls(s.key, s.step, s.phases, s.ranks, s.peak, s.job)

    @classmethod
    def from_means(cls, key: int, step: int, means: dict[str, dict[int, float]]) -> RankWindow:
        """A window from each rank's mean per phase (``{phase: {rank: ms}}``)."""
        s = Summary(key)
        s.step = step
        for phase, by_rank in means.items():
            s.phases[phase] = spread = Spread()
            for rank, ms in sorted(by_rank.items()):
                spread.add(ms, rank)
        s.ranks = len({r for by_rank in means.values() for r in by_rank})
        return cls.of(s)


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

    def put(self, rank: int, totals: dict[str, Any]) -> None:
        """A rank's run totals as it sent them (``_OwnTotals.as_json``), replacing what was there."""
        self.steps[rank] = int(totals["s"])
        self.sums[rank] = {p: [float(s), int(c)] for p, (s, c) in totals["p"].items()}
        if totals.get("m"):
            self.memory[rank] = dict(totals["m"])
        if totals.get("c"):
            self.counts[rank] = {k: float(v) for k, v in totals["c"].items()}

    def mean(self, rank: int, phase: str) -> float | None:
        acc = self.sums.get(rank, {}).get(phase)
        return acc[0] / acc[1] if acc and acc[1] else None


class _OwnTotals:
    """This rank's run totals so far, sent with its reports: the newest one its group's reader holds is all
    rank zero needs for the per-rank table, even if a report was lost with a leader."""

    def __init__(self) -> None:
        self.steps = 0
        self.sums: dict[str, list[float]] = {}
        self.memory: dict[str, float] | None = None
        self.counts: dict[str, float] = {}

    def add(self, steps: int, sums: dict[str, list[float]], memory: dict[str, float] | None,
            counts: dict[str, float] | None) -> None:
        self.steps += steps
        for phase, (total, count) in sums.items():
            acc = self.sums.setdefault(phase, [0.0, 0])
            acc[0] += total
            acc[1] += count
        if memory:
            self.memory = memory
        for k, v in (counts or {}).items():
            self.counts[k] = self.counts.get(k, 0.0) + float(v)

    def as_json(self) -> bytes:
        out: dict[str, Any] = {"s": self.steps, "p": self.sums}
        if self.memory:
            out["m"] = self.memory
        if self.counts:
            out["c"] = self.counts
        return _json(out)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class RankExchange:
    """The exchange of window reports to rank zero through the job's store (see the module's text)."""

    def __init__(self, store: Any, rank: int, world_size: int, namespace: str, *, fan_in: int | None = None) -> None:
        """``fan_in``: children per group of the tree (``FAN_IN``; the tests and benchmarks make small trees)."""
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.tree = Tree(world_size, FAN_IN if fan_in is None else fan_in)
        self.totals = RankTotals(world_size) if rank == 0 else None
        self.broken = False
        self.finished: set[int] = set()  # ranks whose final report came (rank zero, at the end)
        self.gone: set[int] = set()  # ranks taken as gone (rank zero's thread replaces the set)
        self._gone_said: set[int] = set()  # ... of which the training thread has warned
        self._missing: set[int] = set()  # ranks whose final report never came (rank zero, at the end)
        self._outbox: list[bytes] = []  # windows not sent yet, JSON-encoded
        self._own = _OwnTotals()
        self._sent = 0  # exchanges this rank has made
        self._leaf = f"{namespace}/{self.tree.leaf_node(rank).name}"
        self._store = store
        #: The nodes this rank reads: rank zero the root; a group's leader its group (and, rarely, one more).
        self._nodes = [NodeReader(self.tree, node, store, namespace) for node in self.tree.led_by(rank)]
        # The exchange's thread: what to do, and (rank zero) the windows it completed.
        self._todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[RankWindow] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._sent_event = threading.Event()  # set when the newest request is done
        self._sent_event.set()
        self._read_event = self._sent_event  # rank zero: set when its newest read is done
        self._thread = threading.Thread(target=self._run, name=f"phase-timer-ranks-{rank}", daemon=True)
        self._thread.start()

    @property
    def store(self) -> Any:
        return self._store

    @store.setter
    def store(self, store: Any) -> None:
        """A new connection (a wrapper that counts requests): every node this rank reads uses it from now on."""
        self._store = store
        for node in self._nodes:
            node.store = node.reader.store = store

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

    @property
    def _root(self) -> NodeReader | None:
        return self._nodes[0] if self.rank == 0 else None

    # -- the training thread, once a window -------------------------------------------
    def add(self, key: int, last_step: int, steps: int, values: dict[str, list[float]], *,
            memory: dict[str, float] | None = None, counts: dict[str, float] | None = None) -> None:
        """A window this rank has written (its ms per phase; its memory, if read: ``peak_allocated_mb``,
        ``peak_reserved_mb``, ``device_total_mb``, ``alloc_retries``); it goes out with the next exchange.
        """
        if self.broken:
            return  # the exchange stopped: keep nothing (memory stays flat)
        sums = {p: [sum(vs), len(vs)] for p, vs in values.items()}
        report: list[Any] = [key, last_step, steps, sums]
        extra = dict(memory or {})
        if counts:
            extra["counts"] = counts  # the window's samples/tokens and their period: the job's throughput
        if extra:
            report.append(extra)
        self._own.add(steps, sums, memory, counts)
        self._outbox.append(_json(report))

    def exchange(self) -> list[RankWindow]:
        """Read the windows that are complete, hand this rank's reports to the thread; never waits."""
        self._check_error()
        if self.broken:
            return []
        out = self._arrived()
        self._post(final=False)
        return out

    def finish(self, timeout_s: float, *, interrupted: bool = False) -> list[RankWindow]:
        """Send the last windows, wait up to ``timeout_s`` for the reports still missing, write the rest.

        A wait on the other ranks (not on the device), at the end of training only.
        ``interrupted`` (an exception): send nothing more and wait for nothing; what has
        arrived is written.
        """
        out: list[RankWindow] = []
        started = time.monotonic()
        deadline = started + timeout_s
        try:
            self._check_error()
            if not self.broken and not interrupted:
                self._post(final=True)
                if self._nodes:  # read the group(s) this rank leads to their end (rank zero: everything)
                    self._ask("finish", self._sent - 1, started, timeout_s).wait(timeout_s + 2.0)
                else:  # the final report is out (or the deadline passed) before this returns: the process
                    # may go on to a blocking store request of its own, which would queue our send behind it
                    self._sent_event.wait(timeout_s)
                self._check_error()
            elif self.rank == 0 and not self.broken:
                self._ask("flush").wait(1.0)  # what has arrived is written, and the ranks' totals read
            if self.rank == 0:
                out = self._arrived()
                self.finished = set(range(self.world_size)) - self._missing - self.gone
                missing = sorted(self._missing)
                if missing and not interrupted and not self.broken:
                    self._warn(f"rank(s) {missing} sent no final report within {timeout_s:g} s "
                               "(did the ranks run different numbers of steps?)")
                    self._warn(f"rank(s) {missing} had not finished when rank 0 did: their last windows are missing")
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
        """This rank's part of the next exchange, to the thread; a leader's reading of its group."""
        k = self._sent
        self._sent += 1
        batch, self._outbox = self._outbox, []
        body = leaf_body(batch, self._own.as_json() if batch else None)
        self._sent_event = self._ask("send", k, encode(self.rank, body, final=final))
        if final or not self._nodes:
            return
        if self.rank != 0:  # a leader sends its group's frame every exchange: its parent waits for it
            self._sent_event = self._ask("lead", k)
        elif self._read_event.is_set():  # else the read still running is followed by the next one
            self._sent_event = self._read_event = self._ask("read", k)

    def _ask(self, *item: Any) -> threading.Event:
        """A request to the exchange's thread, and an event set once it is done (or failed)."""
        done = threading.Event()
        self._todo.put((*item, done))
        return done

    def _arrived(self) -> list[RankWindow]:
        """The windows rank zero's thread has completed (rank zero only)."""
        if self.rank != 0:
            return []
        for r in sorted(self.gone - self._gone_said):  # warnings belong on the training thread
            self._gone_said.add(r)
            self._warn(f"rank {r} has not reported for {STALE_EXCHANGES} exchanges: taken as gone, the others go on")
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
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
                    self._store.append(f"{self._leaf}/{k}", frame)
                    self._store.add(f"{self._leaf}/{k}/n", 1)
                elif item[0] == "read":
                    self._read_root(item[1])
                elif item[0] == "lead":
                    self._lead(item[1])
                elif item[0] == "finish":
                    self._finish(*item[1:4])
                elif item[0] == "flush":
                    self._end_root()
                item[-1].set()
        except Exception as err:  # noqa: BLE001 - the training thread gives up at its next exchange
            self._error = err
            while item[0] != "stop":  # nothing more is done, and nobody waits for it
                item[-1].set()
                item = self._todo.get()

    def _read_root(self, k: int, *, beyond: bool = False) -> None:
        root = self._root
        assert root is not None
        for s in root.step(k, beyond=beyond):
            self._inbox.put(RankWindow.of(s))
        root.publish_table(own=self.tree.depth > 1)
        self.gone = root.gone_ranks()  # a new set: the training thread reads it

    def _lead(self, k: int) -> None:
        """A leader at exchange ``k``: each node it leads, lowest first."""
        for node in list(self._nodes):
            self._lead_node(node, k)

    def _lead_node(self, node: NodeReader, k: int) -> None:
        """Read a node this rank leads up to exchange ``k``, and send its frame up."""
        if self._adopted(node):
            return
        out = node.step(k)
        node.publish_table()
        self._send_up(node, k, out, final=False)

    def _adopted(self, node: NodeReader) -> bool:
        """Whether the leader above has taken this rank as gone and reads its node now (then it is dropped here)."""
        if not self._store.check([adopted_key(self.namespace, node.node)]):
            return False
        self._nodes.remove(node)
        return True

    def _send_up(self, node: NodeReader, k: int, out: list[Summary], *, final: bool, **extra: Any) -> None:
        parent = self.tree.parent(node.node)
        assert parent is not None
        body = _json({"w": [s.wire() for s in out], **node.notices(), **extra})
        key = f"{self.namespace}/{parent.name}/{k}"
        self._store.append(key, encode(node.node.index, body, final=final))
        self._store.add(f"{key}/n", 1)

    def _finish(self, last: int, started: float, timeout_s: float) -> None:
        """At the end: read each node this rank leads until its children's final reports are in, or its part
        of ``timeout_s`` has passed; then send it up with its final frame (rank zero: write it)."""
        todo = [n for n in self._nodes if n is self._root or not self._adopted(n)]
        held: dict[int, list[Summary]] = {id(n): [] for n in todo}
        while todo:
            for node in list(todo):
                if node is self._root:
                    self._read_root(last, beyond=True)
                else:
                    held[id(node)] += node.step(last, beyond=True)
                end = started + timeout_s * node.node.level / self.tree.depth
                if (node.all_done() and node.settled()) or time.monotonic() >= end:
                    todo.remove(node)
                    if node is self._root:
                        self._end_root()
                    else:
                        self._end_node(node, last, held[id(node)])
            if todo:  # reads 10 ms apart: waiting on the other ranks (not on the device), at the end only
                time.sleep(0.01)

    def _end_node(self, node: NodeReader, last: int, held: list[Summary]) -> None:
        """A led node's final frame: its last windows, the ranks still missing, and whether its parent reads on."""
        handoff = not node.all_done()
        held += node.flush()
        node.publish_table()
        self._send_up(node, last, held, final=True, x=sorted(node.missing()), ho=handoff)
        if not handoff:
            node.forget(self._sent)

    def _end_root(self) -> None:
        """Rank zero at the end: every window left, the ranks missing, the run totals; the keys deleted."""
        root = self._root
        assert root is not None
        for s in root.flush():
            self._inbox.put(RankWindow.of(s))
        self._missing = root.missing()
        self.gone = root.gone_ranks()
        self._read_totals(root)
        root.forget(self._sent)

    def _read_totals(self, root: NodeReader) -> None:
        """Every rank's run totals, from its group's key (one request per 256 groups), for the per-rank table."""
        totals = RankTotals(self.world_size)
        tables = [parse_table(table_bytes(root.table))] if self.tree.depth == 1 else []
        if self.tree.depth > 1:
            keys = [table_key(self.namespace, j) for j in range(-(-self.world_size // self.tree.fan_in))]
            for i in range(0, len(keys), _TABLES_PER_REQUEST):
                chunk = keys[i : i + _TABLES_PER_REQUEST]
                present = chunk if self._store.check(chunk) else [k for k in chunk if self._store.check([k])]
                if present:  # a group whose reader never wrote (died at once) has none: no wait on it
                    tables += [parse_table(raw) for raw in self._store.multi_get(present)]
                for key in present:
                    self._store.delete_key(key)
        for table in tables:
            for rank, (_, mine) in sorted(table.items()):
                totals.put(rank, mine)
        self.totals = totals

    def _give_up(self, why: str) -> None:
        if self.broken:
            return
        self.broken = True
        self._todo.put(("stop",))
        self._warn(f"the exchange between ranks stopped ({why}); each rank's own timing goes on")

    def _warn(self, why: str) -> None:
        msg = f"phase-timer (rank {self.rank}): {why}"
        warn(log, msg, 3)

