"""The run's communication, as a measure (:class:`phase_timer.measure.Measure`): what the splits carried on the
records (the sampled collectives' own time and exposed wait), DDP's copies taken off the wait, the window's
``comm/*`` scalars, the table's line and the summary file's ``communication`` block."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from phase_timer.measure import Measure
from phase_timer.measures.comm.copies import Copies
from phase_timer.phases import BACKWARD, comm_label

WAIT = comm_label(BACKWARD)
#: Carried on a record (sampled): the collectives' own time of a sampled synced backward, and its exposed wait.
COMM_MS, COMM_WAIT_MS, COMM_SAMPLES = "comm_ms", "comm_wait_ms", "comm_samples"
CARRIED = (COMM_MS, COMM_WAIT_MS, COMM_SAMPLES)
PREFIX = "comm"
#: DDP's copies' estimate: each bucket's median over its last COPY_KEEP samples of the copies' own time (queued, back
#: to back, or slower than their launches: ``Copies.own``), summed over the buckets.
COPY_KEEP = 3
#: A step whose span exceeds the copies' estimate by more than this (ms) waited for its collectives (a late peer's):
#: its copies ran after or beside collectives waiting, not moving data, and lose each bucket's quickest sample
#: instead of its median (:func:`less_copies`).
WAITED_MS = 0.25


def less_copies(span: float, copy: float, low: float) -> float:
    """A step's ``backward.comm_wait`` less DDP's copies, never below zero: ``copy`` (each bucket's median, summed),
    or ``low`` (each bucket's quickest sample, summed) where the span exceeds ``copy`` by more than ``WAITED_MS``.

    A bucket's copies run at two speeds on a GPU: beside collectives that move data (NCCL's kernels share the
    device's memory and SMs: ~1.5x slower), or beside none, or beside collectives that wait for a peer.  A rank that
    waits for a late peer runs its copies the second way, after each wait; a step that waits for nobody, the first
    way.  A step that waits for the network itself (one bucket, a slow link) crosses the threshold too: where its
    copies ran beside collectives moving data, it reads high by ``copy - low`` (0.01-0.15 ms on GPT-2-124M, 2 x
    H200).  ``copy`` and ``low`` are summed over the DDP modules: one module's wait moves every module to ``low``.
    A step the host-paced path corrected holds its span less the host's time plus ``copy``
    (``paced.PacedSpans._own_ms``): where what is left exceeds ``WAITED_MS`` it reads high by ``copy - low``.
    Non-decreasing in ``span`` (``low <= copy``: it steps up at the threshold), so sorted values stay sorted."""
    taken = low if span > copy + WAITED_MS else copy
    return span - taken if span > taken else 0.0


def copy_note(run: RunComm) -> str | None:
    """What the table says of DDP's copies inside the wait's span (None: none timed, none expected)."""
    if run.copy_ms is not None:
        unqueued = run.copy_unqueued
        paced = ((f"{unqueued} buckets'" if unqueued != 1 else "1 bucket's") + " copies ran at the pace of DDP's launches on "
                 "every sample (the device had caught up with the host): their own time is not known, nothing is "
                 "taken for them, and a step whose copies queue keeps them in backward.comm_wait")
        if not run.copy_ms and unqueued:
            return f"DDP's copies into .grad, sampled on {run.copy_samples} backwards: {paced}"
        waited = (f"; {run.copy_low_ms:.3f} ms, each bucket's quickest sample, on a step whose span exceeds "
                  f"{run.copy_ms:.3f} by more than {WAITED_MS} ms: it waited, and its copies ran beside collectives "
                  "waiting for a peer" if run.copy_low_ms is not None and run.copy_low_ms < run.copy_ms else "")
        return (f"DDP's copies into .grad ({run.copy_ms:.3f} ms a synced backward, timed where they run on "
                f"{run.copy_samples} sampled backwards{waited}) are backward's and are taken off "
                "backward.comm_wait"
                + (f"; {paced}" if unqueued else ""))
    if run.copy and run.untimed_copies:
        return ("DDP's copies into .grad are inside backward.comm_wait (a parameter without a gradient on this rank, "
                "under find_unused_parameters=True: DDP's wait for its used-parameter map falls "
                "among them, so they are not timed)")
    if run.copy:
        return "DDP's copies into .grad are inside backward.comm_wait (no backward was sampled to time them)"
    return None


def line(run: RunComm) -> str | None:
    """The table's line: the collectives' own time, their exposed wait, the share hidden, and what the span holds
    besides the wait (None: nothing sampled and nothing to say)."""
    c = run.as_dict()
    note = copy_note(run)
    if c is None:
        return f"communication (DDP): {note}" if note else None
    hidden = c.get("hidden_share")
    return (f"communication (DDP, {c['samples']} sampled backwards): collectives {c['collectives_ms']:.3f} ms a step, "
            f"exposed {c['exposed_ms']:.3f} ms (backward.comm_wait)"
            + (f", {100 * hidden:.0f}% hidden behind backward's compute" if hidden is not None else "")
            + (f"; your comm hook {run.hook} composed" if run.hook else "")
            + (f"; {note}" if note else ""))



def split(columns: dict[str, list[float]]) -> dict[str, float]:
    """Take the sampled communication out of a window's columns: ``{comm_ms, comm_wait_ms, comm_samples}``
    summed over the sampled backwards its records carry (empty when none)."""
    got = {name: columns.pop(name, None) for name in CARRIED}
    if not all(got.values()):
        return {}
    return {name: float(sum(values)) for name, values in got.items()}


def hidden_share(comm: dict[str, float]) -> float | None:
    """1 - exposed / communication over the same sampled backwards (None: no communication sampled)."""
    total = comm.get(COMM_MS, 0.0)
    if total <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - comm.get(COMM_WAIT_MS, 0.0) / total))


def scalars(comm: dict[str, float]) -> dict[str, float]:
    """A window's ``comm/collectives_ms`` (mean over its sampled backwards) and ``comm/hidden_share``."""
    n = comm.get(COMM_SAMPLES, 0.0)
    if not n:
        return {}
    out = {f"{PREFIX}/collectives_ms": comm[COMM_MS] / n}
    hidden = hidden_share(comm)
    if hidden is not None:
        out[f"{PREFIX}/hidden_share"] = hidden
    return out


class RunComm(Measure):
    """The run's sampled communication: summed over every window; and DDP's copies inside the wait's span."""

    key = "communication"

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}
        #: The user's comm hook (its name), or None: DDP's own average.
        self.hook: str | None = None
        #: A DDP module split copies its results into ``.grad`` inside the span (``gradient_as_bucket_view=False``).
        self.copy = False
        self._copy_pending: deque[tuple[int, list[Copies], Any]] = deque()
        #: A module's split (its id) -> each bucket's last samples (ms, DDP's order): those whose copies were all
        #: queued before the device reached them (the copies' own time, back to back), and the others (the device
        #: caught up with the host among them: an estimate, ``Copies.ms``).
        self._copy_buckets: dict[int, list[tuple[deque[float], deque[float]]]] = {}
        #: A module's split (its id) -> its copies' estimate (ms: its buckets' medians, summed), and on a step that
        #: waited (each bucket's quickest sample, summed).
        self._copy_module: dict[int, float] = {}
        self._copy_low: dict[int, float] = {}
        #: DDP's copies as they run in its end-of-backward (each bucket's, from before its first copy to after
        #: its last, summed), taken off ``backward.comm_wait``: ms a synced backward (each module's
        #: buckets' medians, summed, over the modules), or None.
        self.copy_ms: float | None = None
        #: The same where a step waited for its collectives (:func:`less_copies`): each bucket's quickest sample.
        self.copy_low_ms: float | None = None
        self._copy_counts: dict[int, int] = {}  # a module's split (its id) -> its samples read
        #: A module whose copies are not timed (DDP read its used-parameter map among them): they stay in the wait.
        self.untimed_copies = False

    def add(self, comm: dict[str, float]) -> None:
        for k, v in comm.items():
            self.counts[k] = self.counts.get(k, 0.0) + v

    def add_copies(self, probe: Any, pairs: list[Copies], clock: Any) -> None:
        """One sampled end-of-backward's copies: each bucket's (:class:`~phase_timer.measures.comm.copies.Copies`)."""
        self._copy_pending.append((id(probe), pairs, clock))

    def resolve_copies(self) -> None:
        """The sampled copies whose marks are done (``clock.done``: a query, never a wait), into :attr:`copy_ms`."""
        pending = self._copy_pending
        while pending:
            key, pairs, clock = pending[0]
            if not clock.done(pairs[-1].end):
                return
            pending.popleft()
            buckets = self._copy_buckets.get(key)
            if buckets is None or len(buckets) != len(pairs):  # DDP rebuilt its buckets: their samples start anew
                buckets = self._copy_buckets[key] = [(deque(maxlen=COPY_KEEP), deque(maxlen=COPY_KEEP)) for _ in pairs]
            device = clock.kind != "host"  # on the host clock the copies run as the host makes them: their own time
            for pair, (own, paced) in zip(pairs, buckets):
                (own if pair.own(clock) or not device else paced).append(pair.ms(clock))
            clock.release([m for pair in pairs for m in (pair.start, pair.end)])
            self._copy_counts[key] = self._copy_counts.get(key, 0) + 1
            # A bucket's copies move the same bytes every step: their own time is its samples' that hold it
            # (Copies.own: queued, or slower than their launches); a device that caught up with the host runs them
            # at the pace of DDP's launches, 3-5x their own on 2 x H200, which a host-paced step loses whole where
            # the paced path's questions say so (paced.PacedSpans); a bucket with no such sample adds nothing.
            self._copy_module[key] = float(sum(statistics.median(own) for own, _ in buckets if own))
            self._copy_low[key] = float(sum(min(own) for own, _ in buckets if own))
            self.copy_ms = sum(self._copy_module.values())
            self.copy_low_ms = sum(self._copy_low.values())

    def forget_copies(self, probe: Any) -> None:
        """One module's copies are untimed from now on: its samples and estimate go (those not resolved yet too)."""
        key = id(probe)
        for _, pairs, clock in (item for item in self._copy_pending if item[0] == key):
            clock.release([m for pair in pairs for m in (pair.start, pair.end)])
        self._copy_pending = deque(item for item in self._copy_pending if item[0] != key)
        self._copy_buckets.pop(key, None)
        self._copy_module.pop(key, None)
        self._copy_low.pop(key, None)
        self._copy_counts.pop(key, None)
        self.copy_ms = sum(self._copy_module.values()) if self._copy_module else None
        self.copy_low_ms = sum(self._copy_low.values()) if self._copy_low else None

    @property
    def copy_samples(self) -> int:
        """Sampled end-of-backwards whose copies were read, over the modules still timed."""
        return sum(self._copy_counts.values())

    @property
    def copy_unqueued(self) -> int:
        """Buckets whose copies no sample saw queued (every sample caught up with the host): no estimate of theirs."""
        return sum(not own for buckets in self._copy_buckets.values() for own, _ in buckets)

    def unqueued(self, probe: Any) -> bool:
        """Whether one module's copies have a bucket no sample saw queued (its estimate leaves that bucket out), with
        no sample of its copies still to resolve (that one may bring it in)."""
        key = id(probe)
        return not any(item[0] == key for item in self._copy_pending) \
            and any(not own for own, _ in self._copy_buckets.get(key, ()))

    def module_copy_ms(self, probe: Any) -> float:
        """The copies' estimate of one module's split (ms; 0.0 before any)."""
        return self._copy_module.get(id(probe), 0.0)

    def take_copies(self, columns: dict[str, list[float]], comm: dict[str, float]) -> None:
        """Take DDP's copies off a window's ``backward.comm_wait`` (each step's, :func:`less_copies`, never below
        zero, copies or not: a host-paced step's own correction may take more than its span,
        ``paced.PacedSpans._settle``; sorted stays sorted) and off its sampled exposed wait."""
        self.resolve_copies()
        copy = self.copy_ms or 0.0
        low = self.copy_low_ms or 0.0
        waits = columns.get(WAIT)
        if waits and (copy or waits[0] < 0):
            columns[WAIT] = [less_copies(v, copy, low) for v in waits]
        if copy and comm.get(COMM_SAMPLES):
            comm[COMM_WAIT_MS] = max(0.0, comm[COMM_WAIT_MS] - copy * comm[COMM_SAMPLES])

    def take_copy(self, ms: dict[str, float]) -> None:
        """The same off one step's phases (its own line in the sinks)."""
        if self._copy_pending:
            self.resolve_copies()
        wait = ms.get(WAIT)
        if wait is not None:
            ms[WAIT] = less_copies(wait, self.copy_ms or 0.0, self.copy_low_ms or 0.0)

    # -- the measure -------------------------------------------------------------------------
    def window(self, columns: dict[str, list[float]]) -> dict[str, float]:
        """The window's sampled communication out of its columns, DDP's copies off its wait; its scalars."""
        comm = split(columns)
        self.take_copies(columns, comm)  # DDP's copies into .grad are backward's, not its wait's
        if comm:
            self.add(comm)
        return scalars(comm)

    def step(self, ms: dict[str, float]) -> None:
        for name in CARRIED:
            ms.pop(name, None)  # samples, not phases: a step's are its window's
        self.take_copy(ms)

    def line(self) -> str | None:
        return line(self)

    def summary(self) -> dict[str, Any] | None:
        """DDP's sampled collectives and their exposed wait, and DDP's copies taken off that wait (None: no DDP
        module split, or nothing sampled)."""
        out = self.as_dict()
        if out is None and self.copy_ms is None:
            return None
        out = out or {}
        return {"collectives_ms": out.get("collectives_ms"), "exposed_ms": out.get("exposed_ms"),
                "samples": out.get("samples", 0), "hidden_share": out.get("hidden_share"), "hook": self.hook,
                "copies_ms": self.copy_ms, "copies_waited_ms": self.copy_low_ms, "copy_samples": self.copy_samples,
                "copies_unqueued": self.copy_unqueued}

    def as_dict(self) -> dict[str, float] | None:
        n = self.counts.get(COMM_SAMPLES, 0.0)
        if not n:
            return None
        out = {"collectives_ms": self.counts[COMM_MS] / n, "exposed_ms": self.counts[COMM_WAIT_MS] / n,
               "samples": int(n)}
        hidden = hidden_share(self.counts)
        if hidden is not None:
            out["hidden_share"] = hidden
        return out


def find(core: Any) -> RunComm | None:
    """``core``'s communication measure (None: it has none)."""
    return next((m for m in core.measures if isinstance(m, RunComm)), None)


def of(core: Any) -> RunComm:
    """``core``'s communication measure: the one it was given, else a new one it listens to from now on (a split
    module binds to it: a run with none has no communication to report)."""
    run = find(core)
    if run is None:
        run = RunComm()
        core.listen(run)
    return run
