"""Memory per phase: the caching allocator's counters at a sampled step's boundaries, never a sync.

The CUDA caching allocator keeps its counters on the host, updated when the host issues an
allocation or a free, so a read at a boundary says exactly what the phases before it hold
on the host's timeline (the device may run behind: the memory is reserved for its work all
the same).  No read waits for the device.

What a read costs decides the design.  ``torch.cuda.memory_allocated()`` flattens the whole
statistics tree in Python (~174 µs on an H100); the raw ``torch._C._cuda_memoryStats(index)``
builds the tree in C++ (10-24 µs); nothing cheaper exists in torch 2.11 (``docs/design.md``).
Five reads a step would cost more than the time phases themselves, so memory is *sampled*:
a memory step reads the counters at each boundary it passes (step begin, each phase's begin,
step end), densely at first (the first :data:`DENSE` steps begun, warm-up ones included:
the run's peak is most often set by the first optimizer step), then :data:`MEDIUM_GAP`
apart until :data:`MEDIUM` samples, then :data:`SPARSE_GAP` apart, at random so that no
periodic work aliases with them.  In a steady loop memory per phase is the same from step
to step, so a sample in ~128 steps loses nothing but the moment a change happens.

The peak's phase: the phase whose rise of the allocator's peak counter, between two reads, brought it
within :func:`peak_tolerance` of the run's peak (1% of the peak, at least 16 MB, at most 10% of it).  It is kept until a
later rise beats that tolerance: a rise of a few KB on a step not read (allocation order varies from
step to step) does not give it away.  A rise that no read pair holds is "between samples" only when it
beats the tolerance too, and a named phase takes over from it (a read came close).  Each phase's
highest reading of the counter after a rise in it is kept as well (``phase_peaks_mb``).

:class:`Memory` is the measure (:class:`phase_timer.measure.Measure`): the summary file's ``memory`` block (with each
rank's peaks on rank zero), this rank's peaks in its window report, what the verdict's memory rules read and
memory's share of the own-cost line.  The boundaries read the counters through its :attr:`Memory.tracker` and hand
each closed memory step's values to the core, which writes them at their step.

Nothing here resets the allocator's peak: ``torch.cuda.max_memory_allocated()`` returns
what it would without phase-timer (Lightning's ``DeviceStatsMonitor``, the 🤗 Trainer's memory
metrics and users' own logging read it).
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

from phase_timer._env import warn
from phase_timer.measure import Measure
from phase_timer.phases import BEFORE, BETWEEN, H2D, PAUSED

log = logging.getLogger(__name__)

#: The first steps begun that are all sampled (warm-up steps included) ...
DENSE = 8
#: ... then one in MEDIUM_GAP until MEDIUM samples (the creep rule gets its points within ~100 steps) ...
MEDIUM = 16
MEDIUM_GAP = (4, 12)
#: ... then one in SPARSE_GAP (a mean of 128 steps: a memory step costs 134-195 µs in an H100 host's hot loop,
#: 1.0-1.5 µs a step).
SPARSE_GAP = (64, 192)
#: The device's free memory (``cudaMemGetInfo``, 11-16 µs) is read on the first memory step and every DEVICE_EVERY-th.
DEVICE_EVERY = 8
#: Samples from steps before this one begun are not steady: the first optimizer step allocates its state.
STEADY_FROM = 3
#: Reads a memory step keeps at most: a step that never ends (no optimizer step heard) stops being read.
MAX_READS = 64
#: Steady samples of the step's begin kept for the creep rule and the summary file (thinned by half when full).
MAX_POINTS = 256
MB = float(1 << 20)
#: The peak's phase is kept against rises smaller than this share of the peak, or than PEAK_TOLERANCE_MB (the
#: larger), but never than PEAK_TOLERANCE_MAX_SHARE of it: the same peak reached again varies by KB to MB
#: (allocation order, the caching allocator's rounding of blocks), and a small model's phases differ by a few MB.
PEAK_TOLERANCE_SHARE = 0.01
PEAK_TOLERANCE_MB = 16
PEAK_TOLERANCE_MAX_SHARE = 0.1
#: The peak's phase when a rise beyond the tolerance happened where no pair of reads holds it.
BETWEEN_SAMPLES = "between samples"
#: What a memory step writes that is the run's or the device's, not allocated at a boundary: no steady statistic.
_NOT_BOUNDARIES = frozenset({"peak_allocated", "peak_reserved", "reserved", "device_free"})


def peak_tolerance(peak: int) -> int:
    """How far (bytes) a peak read may be from ``peak`` and still be the same peak reached again: 1% of it, at
    least 16 MB, at most 10% of it."""
    return min(max(int(PEAK_TOLERANCE_SHARE * peak), PEAK_TOLERANCE_MB << 20), int(PEAK_TOLERANCE_MAX_SHARE * peak))


class Reading(NamedTuple):
    """The allocator's counters at one moment (bytes), and its count of retried allocations."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    retries: int


Reader = Callable[[], Reading]


def cuda_reader(index: int) -> Reader:
    """The counters of CUDA device ``index``: one call of ``torch._C._cuda_memoryStats`` (no sync, no reset)."""
    import torch

    stats = torch._C._cuda_memoryStats

    def read() -> Reading:
        s = stats(index)
        a, r = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
        return Reading(a["current"], r["current"], a["peak"], r["peak"], s.get("num_alloc_retries", 0))

    return read


def cuda_device_info(index: int) -> Callable[[], tuple[int, int]]:
    """(free, total) bytes of the device as the driver sees them (``cudaMemGetInfo``: no sync, 11-16 µs)."""
    import torch

    return lambda: torch.cuda.mem_get_info(index)


def reader_for(clock: Any) -> tuple[Reader, Callable[[], tuple[int, int]]] | None:
    """The counters' reader and the device's (free, total) for the clock's device; None off CUDA.

    On the host clock memory is absent (not zero): a CPU has no caching allocator to read.
    The tests plant a fake allocator here.
    """
    index = getattr(getattr(clock, "device", None), "index", None)
    if getattr(clock, "kind", None) != "cuda" or index is None:
        return None
    return cuda_reader(index), cuda_device_info(index)


class _Stat:
    """Mean and max of a value over the steady samples."""

    __slots__ = ("n", "total", "max")

    def __init__(self) -> None:
        self.n, self.total, self.max = 0, 0.0, float("-inf")

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v
        self.max = max(self.max, v)

    def as_dict(self) -> dict[str, float] | None:
        return {"mean": self.total / self.n, "max": self.max} if self.n else None


class MemoryTracker:
    """One run's memory samples: which steps are read, what each phase holds, where the peak was set.

    The boundaries call :meth:`begin` when a step at or after :attr:`next_due` begins, :meth:`read` at each
    of its boundaries, and :meth:`end_step` (or :meth:`drop`) when it closes; :meth:`mark` outside it.
    """

    def __init__(self, read: Reader, device_info: Callable[[], tuple[int, int]] | None = None,
                 *, seed: int | None = None) -> None:
        self._read = read
        self._device_info = device_info
        self._rng = random.Random(seed)
        self._next = 1  # the step (1-based, begun) to sample next
        self.samples = 0
        self._reads: list[tuple[str, Reading]] = []
        self._begun = 0
        self.step = 0
        #: Per boundary (the phase that begins there; ``step_begin``, ``step_end``; ``activations``): allocated MB.
        self.stats: dict[str, _Stat] = {}
        self.reserved = _Stat()
        #: The run's peaks (MB): the highest read (a user's reset lowers the counter, never these).
        self.peak_allocated_mb: float | None = None
        self.peak_reserved_mb: float | None = None
        #: The phase whose rise brought the counter within the tolerance of the run's peak, and at which step.
        self.peak_phase: str | None = None
        self.peak_step: int | None = None
        self._peak_level = 0  # the counter (bytes) when peak_phase was named
        self._named = False  # peak_phase is a phase (not BEFORE or BETWEEN_SAMPLES)
        #: Per phase: the highest counter (bytes) read after it rose in that phase.
        self.phase_peaks: dict[str, int] = {}
        # The last read: (step begun, the door's step, the phase running after it, the reading).
        self._last: tuple[int, int, str, Reading] | None = None
        self._max_alloc = self._max_reserved = -1  # the highest peaks read (bytes): a user's reset lowers the counter
        self._retries0: int | None = None
        self.retries = 0
        #: (the door's step, allocated MB at its begin) of the steady samples, for the creep rule.
        self.points: list[tuple[int, float]] = []
        self._thin = 1  # keep one steady point in _thin (doubles when the list is full)
        self._seen = 0
        self.device_total_mb: float | None = None
        self.device_free_mb: float | None = None  # the least free memory read
        #: Why memory stopped being read mid-run (None: it did not stop); what was read before stays.
        self.failed: str | None = None
        self.device_error: str | None = None  # why cudaMemGetInfo stopped being read (the rest goes on)
        #: Host time spent on memory (set by the boundaries, which time each call): the own-cost line's share.
        self.own_ns = 0
        #: The last memory step closed: its step, its values (MB, as :meth:`end_step` returns them) and its reads
        #: in order (what an out-of-memory error's finding says each phase held: ``phase_timer/measures/oom.py``).
        self.last: tuple[int, dict[str, float], list[tuple[str, Reading]]] | None = None

    # -- the boundaries ----------------------------------------------------------------
    @property
    def next_due(self) -> int:
        """The step (1-based, begun, warm-up ones counted) to sample next: the boundaries sample the first
        step begun at or after it that the verdict does not sample."""
        return self._next

    @property
    def full(self) -> bool:
        """The memory step has read MAX_READS times: a step that never ends reads no more."""
        return len(self._reads) >= MAX_READS

    def begin(self, begun: int, step: int, phase: str) -> None:
        """A sampled step begins with ``phase``: its first read."""
        self._reads = []
        self._begun, self.step = begun, step
        self.read(phase)

    def read(self, phase: str) -> None:
        """The counters now, at the boundary of this memory step where ``phase`` begins (no sync)."""
        reading = self._read()
        self._attribute(phase, reading, self._begun, self.step, in_step=bool(self._reads))
        self._reads.append((phase, reading))

    def mark(self, phase: str, begun: int, step: int) -> None:
        """A read outside a memory step (a pause begins or ends, the run ends), for the peak's phase only:
        a rise since the last read belongs to the phase that read began, when that read was a pause's
        begin or this same step's; else to no one phase (:meth:`_rise`)."""
        self._attribute(phase, self._read(), begun, step, in_step=False, mark=True)

    def relabel(self, phase: str) -> None:
        """What has run since the last read was ``phase``'s, and goes on (the door found out later:
        accumulation's idle, a second backward's loss math, the batch going on after a provisional end)."""
        if self._reads:
            self._reads[-1] = (phase, self._reads[-1][1])
        if self._last is not None:
            self._last = (*self._last[:2], phase, self._last[3])

    def _attribute(self, phase: str, r: Reading, begun: int, step: int, *, in_step: bool, mark: bool = False) -> None:
        """Did the allocator's peak counter move since the last read?  It rose in the phase between the two reads.

        The run's peak is the highest read, not the last read: a user's ``reset_peak_memory_stats()``
        lowers the counter (phase-timer never calls it).  A counter lower than the last read (a reset
        between them) says what was reached since the reset: a rise too, which counts for the peak's phase
        only if it comes within the tolerance of the run's peak.
        """
        last, self._last = self._last, (begun, step, phase, r)
        if self._retries0 is None and (begun >= STEADY_FROM or mark):
            self._retries0 = r.retries  # warm-up's retries (cuDNN's benchmark probing) are not the run's
        self.retries = max(0, r.retries - self._retries0) if self._retries0 is not None else 0
        if last is None:
            self.peak_phase, self.peak_step, self._peak_level, self._named = BEFORE, None, r.peak_allocated, False
        elif r.peak_allocated != last[3].peak_allocated:
            l_begun, l_step, l_phase, _ = last
            if mark:
                known = l_phase == PAUSED or l_begun == begun
            else:  # within this memory step, or from the step just before's end to this one's begin
                known = in_step or (l_begun == begun - 1 and l_phase == BETWEEN)
            self._rise(l_phase, l_step, r.peak_allocated) if known else self._rise(None, step, r.peak_allocated)
        self._max_alloc = max(self._max_alloc, r.peak_allocated)
        self._max_reserved = max(self._max_reserved, r.peak_reserved)
        self.peak_allocated_mb = self._max_alloc / MB
        self.peak_reserved_mb = self._max_reserved / MB

    def _rise(self, phase: str | None, step: int, level: int) -> None:
        """The counter reached ``level`` (bytes) in ``phase`` at ``step`` (None: between two reads of no one phase).

        A named phase is kept until a rise beats it by the tolerance; a phase takes over from "between
        samples" (or from before the first read) as soon as it comes within the tolerance of the run's peak.
        """
        if phase is not None:
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), level)
        peak = max(self._max_alloc, level)
        tol = peak_tolerance(peak)
        if level < peak - tol:
            return  # after a reset, below the run's peak: not where the peak is
        beats = level > self._peak_level + tol
        if phase is not None and (beats or not self._named):
            self.peak_phase, self.peak_step, self._peak_level, self._named = phase, step, level, True
        elif phase is not None and phase == self.peak_phase:  # the same phase a little higher: the mark moves up
            self._peak_level = max(self._peak_level, level)
        elif phase is None and beats:
            self.peak_phase, self.peak_step, self._peak_level, self._named = BETWEEN_SAMPLES, step, level, False

    def drop(self) -> None:
        """The step was dropped (never ended): its reads tell no phase's memory."""
        self._reads = []
        self._schedule()

    def end_step(self) -> dict[str, float]:
        """The sampled step closed: fold its reads in; returns its scalars (MB) for the sinks."""
        reads, self._reads = self._reads, []
        self.samples += 1
        self._schedule()
        out = {"step_begin": reads[0][1].allocated / MB}
        for phase, r in reads:  # each phase's first begin (h2d's is the step's); the step's last end
            if phase == BETWEEN:
                out["step_end"] = r.allocated / MB
            elif phase != H2D:
                out.setdefault(f"{phase}_begin", r.allocated / MB)
        if "forward_begin" in out and "backward_begin" in out:
            out["activations"] = out["backward_begin"] - out["forward_begin"]
        last = reads[-1][1]
        out["reserved"] = last.reserved / MB
        out["peak_allocated"] = last.peak_allocated / MB
        out["peak_reserved"] = last.peak_reserved / MB
        self._device(out)
        if self._begun >= STEADY_FROM:
            for k, v in out.items():
                if k not in _NOT_BOUNDARIES:
                    self.stats.setdefault(k, _Stat()).add(v)
            self.reserved.add(out["reserved"])
            self._point(self.step, out["step_begin"])
        self.last = (self.step, out, reads)
        return out

    def reads_so_far(self) -> tuple[int, list[tuple[str, Reading]]]:
        """The memory step under way: its step and its reads so far (none between memory steps)."""
        return self.step, list(self._reads)

    def now(self) -> tuple[Reading, tuple[int, int] | None]:
        """The counters and the device's (free, total) bytes now, once, outside the schedule (no sync)."""
        info = None
        if self._device_info is not None:
            try:
                info = self._device_info()
            except Exception:  # noqa: BLE001 - a driver that cannot say: the counters still tell
                info = None
        return self._read(), info

    def _device(self, out: dict[str, float]) -> None:
        if self._device_info is None or (self.samples - 1) % DEVICE_EVERY:
            return
        try:
            free, total = self._device_info()
        except Exception as err:  # noqa: BLE001 - a driver that cannot say: the rules that need it abstain
            self.device_error, self._device_info = f"{type(err).__name__}: {err}", None
            return
        self.device_total_mb = total / MB
        out["device_free"] = free / MB
        self.device_free_mb = free / MB if self.device_free_mb is None else min(self.device_free_mb, free / MB)

    def _point(self, step: int, mb: float) -> None:
        self._seen += 1
        if (self._seen - 1) % self._thin:
            return
        self.points.append((step, mb))
        if len(self.points) >= MAX_POINTS:  # bounded memory over any run length: every other point, the newest kept
            self.points = self.points[::-2][::-1]
            self._thin *= 2

    def _schedule(self) -> None:
        if self._next <= DENSE:
            gap = 1
        elif self.samples < MEDIUM:
            gap = self._rng.randint(*MEDIUM_GAP)
        else:
            gap = self._rng.randint(*SPARSE_GAP)
        self._next = max(self._next, self._begun) + gap

    # -- the run's end -------------------------------------------------------------------
    def creep(self) -> dict[str, Any] | None:
        """The least-squares slope of allocated MB at the step's begin over the steady samples (None: < 2)."""
        pts = self.points
        if len(pts) < 2:
            return None
        xs, ys = [float(x) for x, _ in pts], [y for _, y in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        rises = sum(b > a for a, b in zip(ys, ys[1:]))
        return {"mb_per_step": slope, "points": len(pts), "from_step": pts[0][0], "to_step": pts[-1][0],
                "rise_mb": ys[-1] - ys[0], "rising_share": rises / (len(ys) - 1)}

    def as_dict(self) -> dict[str, Any]:
        """What the summary file and the rules read."""
        return {
            "samples": self.samples,
            "steady_samples": self.stats["step_begin"].n if "step_begin" in self.stats else 0,
            "allocated_mb": {k: s.as_dict() for k, s in self.stats.items()},
            "reserved_mb": self.reserved.as_dict(),
            "peak_allocated_mb": self.peak_allocated_mb,
            "peak_reserved_mb": self.peak_reserved_mb,
            "peak_phase": self.peak_phase,
            "peak_step": self.peak_step,
            "phase_peaks_mb": {k: v / MB for k, v in sorted(self.phase_peaks.items(), key=lambda kv: -kv[1])},
            "alloc_retries": self.retries,
            "device_total_mb": self.device_total_mb,
            "device_free_mb": self.device_free_mb,
            "creep": self.creep(),
            "stopped": self.failed,
            "device_error": self.device_error,
            "step_begin_points": [list(p) for p in self.points],
        }


def tracker_of(measures: Any) -> MemoryTracker | None:
    """The tracker of the :class:`Memory` measure among ``measures`` (a core's; None: memory is not read)."""
    found = next((m for m in measures if isinstance(m, Memory)), None)
    return found.tracker if found is not None else None


class Memory(Measure):
    """Memory per phase, the measure: a :class:`MemoryTracker` the boundaries read, and what the run says of it.

    Args:
        tracker: the run's samples (the boundaries call it).
        ranks: the rank exchange (``distributed.ranks.RankExchange``; None: one process): rank zero's per-rank peaks.
    """

    key = "memory"

    def __init__(self, tracker: MemoryTracker, ranks: Any = None) -> None:
        self.tracker = tracker
        self.ranks = ranks

    @classmethod
    def start(cls, clock: Any, ranks: Any = None) -> Memory | None:
        """The measure for the clock's device (None off CUDA, where memory is absent, not zero)."""
        try:
            found = reader_for(clock)
            return cls(MemoryTracker(*found), ranks) if found is not None else None
        except Exception as err:  # noqa: BLE001 - a torch without the allocator's counters: time only
            warn(log, f"phase-timer: memory is not read ({type(err).__name__}: {err}); the time phases go on")
            return None

    @classmethod
    def listening(cls, clock: Any, ranks: Any = None) -> list[Memory]:
        """``[the measure]`` for a core made by hand (``TimingCore(measures=Memory.listening(clock))``), ``[]`` off
        CUDA: the doors' assembly registers it with the others."""
        found = cls.start(clock, ranks)
        return [found] if found is not None else []

    def state(self) -> dict[str, float]:
        """What this rank's window report says of its memory (nothing before the first read)."""
        t = self.tracker
        if t.peak_allocated_mb is None:
            return {}
        return {"peak_allocated_mb": t.peak_allocated_mb, "peak_reserved_mb": t.peak_reserved_mb,
                "device_total_mb": t.device_total_mb, "alloc_retries": t.retries}

    def summary(self) -> dict[str, Any]:
        """Memory per phase as the summary file and the rules read it (rank zero: each rank's peaks too)."""
        out = self.tracker.as_dict()
        totals = self.ranks.totals if self.ranks is not None else None
        if totals is not None and totals.memory:
            out["ranks"] = {str(r): dict(v) for r, v in sorted(totals.memory.items())}
        return out

    def verdict(self) -> dict[str, Any]:
        return {"memory": self.summary()}

    def cost(self) -> dict[str, Any]:
        """All its host time (memory steps only), over its memory steps, and the sparse schedule's mean gap."""
        return {"memory_ns": self.tracker.own_ns, "memory_steps": self.tracker.samples,
                "memory_gap": sum(SPARSE_GAP) / 2}

    def us_per_step(self, steps: int) -> float | None:
        """Its host time over ``steps`` steps begun (µs; None: none begun)."""
        return self.tracker.own_ns / steps / 1e3 if steps else None
