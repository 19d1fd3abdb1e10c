"""Which module's gate (CUDA): the side stream's sleep that holds a sample's kernels until they are queued, sized per
group from what its last sample read needed (``docs/modules.md``)."""

from __future__ import annotations

import time
from typing import Any

import torch

#: CUDA: a sample's gate (``_Gate``), per group: the run's first one's length without the host's time of the step
#: before (GATE_FIRST_MS; with it, that times the margin plus GATE_PAD_MS); then, from the group's last sample read,
#: the sleep that would have left every mark queued in time (the host's time to each mark less the device's time
#: known to be its own before it, at most) times the margin plus GATE_PAD_MS, within [GATE_MIN_MS, GATE_MAX_MS] and
#: never past the run's median step period (times the margin, plus the pad) once a window has been read; the SM
#: clock's rate assumed until a sleep is measured (cycles a ms).  (Whether a sample has a gate at all: ``times.GATE``.)
#:
#: The margin is the run's, applied at each gate's length: GATE_MARGIN_START at first, so that a host whose time to a
#: group's sample moves by up to 2x before any mark was late is covered; GATE_EASE samples in a row read with every
#: mark in time halve it, down to GATE_MARGIN; a sample with a mark queued late (its gate short of the host's time)
#: doubles it, up to GATE_MARGIN_MAX, for every group's next gate, so that a host whose time moves by up to ~2.5x
#: between two samples of a group (a shared or loaded host) is covered again from the sample after a miss.  A quiet
#: host keeps the least gate after its first GATE_EASE samples.
GATE_FIRST_MS = 10.0
GATE_MARGIN = 1.25
GATE_MARGIN_START = 2.5
GATE_MARGIN_MAX = 3.0
GATE_EASE = 8
GATE_PAD_MS = 0.25
GATE_MIN_MS = 0.5
GATE_MAX_MS = 100.0
GATE_CYCLES_PER_MS = 1.5e6


class _Gate:
    """CUDA: at a sample's begin the compute stream waits on a sleep on a side stream (``torch.cuda._sleep``,
    one thread), sized per group from its last sample read (:meth:`size`), so that the kernels between its marks are
    queued before the device runs them and its marks hold device time only (see :meth:`Sample.values` for the check
    that it did)."""

    def __init__(self, clock: Any, cuda: bool = True) -> None:
        self.clock = clock
        self.device = getattr(clock, "device", None)
        # high priority: its one-thread sleep starts at once (cuda=False: the sizing alone, as the CPU tests use it)
        self.side = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        rate = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 0) if cuda else 0  # kHz: cycles a ms
        self.cycles_per_ms = float(rate) if rate else GATE_CYCLES_PER_MS
        #: per group: the sleep its last sample read needed (the margin and the pad are applied at each length, so a
        #: margin the run widened reaches every group's next gate)
        self.need: dict[int, float] = {}
        self.last_need: float | None = None  # the last need read (a group not yet read takes it); None: none yet
        self.margin = GATE_MARGIN_START  # the run's: halved by GATE_EASE covered in a row, doubled by a late sample
        self.covered = 0  # samples read in a row with every mark in time
        self.period: float | None = None  # the run's median step period, once a window is read (:meth:`bound`)
        self.capped = 0  # gates sized at the cap
        #: per group: its last sample's sleep, the host's ms from the gate to its last mark, and whether a mark was late
        self.last: dict[int, tuple[float, float, bool]] = {}
        #: Groups whose step waits for the device inside it (a sync, or a full launch queue): the host's time to its
        #: last mark grew with the sleep, so no gate covers them; theirs is GATE_MIN_MS from then on (their late
        #: spans are not read).
        self.futile: set[int] = set()

    def length(self, group: int, host_ms: float | None = None) -> float:
        """The sleep for ``group``'s next sample: its own sized length; else the last one sized (another group's);
        else, for the run's first, the host's time of the step before (``host_ms``, the boundaries' pilot) with the
        margin, or GATE_FIRST_MS without one."""
        if group in self.futile:
            return GATE_MIN_MS
        need = self.need.get(group, self.last_need)
        if need is None:
            if host_ms is None:
                return min(self.cap, GATE_FIRST_MS)
            need = host_ms
        return self._sized(need)

    def _sized(self, need_ms: float) -> float:
        """A need with the run's margin and the pad, within [GATE_MIN_MS, the cap]."""
        return min(self.cap, max(GATE_MIN_MS, need_ms * self.margin + GATE_PAD_MS))

    @property
    def by_group(self) -> dict[int, float]:
        """Each group read so far: the length of its next gate."""
        return {g: self.length(g) for g in self.need}

    @property
    def ms(self) -> float | None:
        """The length a group not yet read would take (the last need read, sized now); None before any read."""
        return None if self.last_need is None else self._sized(self.last_need)

    @property
    def cap(self) -> float:
        """No gate longer than the run's step period with the run's margin, plus the pad (:meth:`bound`);
        GATE_MAX_MS before a window."""
        if self.period is None:
            return GATE_MAX_MS
        return min(GATE_MAX_MS, max(GATE_MIN_MS, self.period * self.margin + GATE_PAD_MS))

    def hold(self, group: int, host_ms: float | None = None) -> tuple[int, Any, Any, int]:
        """Queue the gate: (host ns, the sleep's first mark, its last, cycles).  No sync: a launch and a stream wait."""
        cycles = max(1, int(self.length(group, host_ms) * self.cycles_per_ms))
        compute = torch.cuda.current_stream(self.device)
        host = time.perf_counter_ns()
        with torch.cuda.stream(self.side):
            first = self.clock.mark()
            torch.cuda._sleep(cycles)
            last = self.clock.mark()
            release = self.side.record_event()
        compute.wait_event(release)
        return host, first, last, cycles

    def size(self, group: int, slept_ms: float, need_ms: float, host_ms: float, late: bool) -> None:
        """The group's next gate, from a sample read (:meth:`Sample.values`): it slept ``slept_ms``; ``need_ms`` is the
        sleep that would have left every mark queued in time, counting as the device's own only the spans it is known
        to have run back to back (never less than what was needed; exact when every mark was in time); ``host_ms`` is
        the host's time from the gate to the sample's last mark; ``late``: a mark was queued after the device reached
        the one before.  With the margin, within [GATE_MIN_MS, the cap].  A device still busy with earlier steps (a
        GPU-bound run) leaves the need below zero: the gate shrinks to GATE_MIN_MS.

        The host's own time does not depend on the sleep, unless the host waits for the device inside the step (a
        sync, or a launch queue filled while the device sleeps): where a sleep longer by a ms or more than the
        group's last, itself late, left a mark late again and the host's time to its last mark grew by half the
        difference or more, the group is :attr:`futile`.

        Kept is the need (:attr:`need`); the margin and the pad are applied at each :meth:`length`.  A late mark on a
        group that is not futile doubles the run's margin (up to GATE_MARGIN_MAX), for every group's next gate: the
        host's time moved past the last margin, and may again; GATE_EASE samples in a row with every mark in time
        halve it (down to GATE_MARGIN)."""
        last = self.last.get(group)
        self.last[group] = (slept_ms, host_ms, late)
        if late and last is not None and last[2]:
            more = slept_ms - last[0]
            if more >= 1.0 and host_ms - last[1] >= more / 2:
                self.futile.add(group)
        if late and group not in self.futile:
            self.margin, self.covered = min(GATE_MARGIN_MAX, self.margin * 2), 0
        elif not late:
            self.covered += 1
            if self.covered >= GATE_EASE and self.margin > GATE_MARGIN:
                self.margin, self.covered = max(GATE_MARGIN, self.margin / 2), 0
        self.need[group] = self.last_need = need_ms
        self.capped += need_ms * self.margin + GATE_PAD_MS > self.cap

    def bound(self, period_ms: float) -> None:
        """No gate longer than the run's step period with the run's margin: within a step the host falls no further
        behind the device than the step's own time, but for the hooks' host time and a host whose time moved (what
        the margin covers), and a longer sleep would only be waited for (a sync inside the step waits for it,
        whatever its length)."""
        if period_ms > 0:
            self.period = period_ms

    def calibrate(self, slept_ms: float, cycles: int) -> None:
        """The SM clock's rate from a sleep's measured length (the device's clock moves with its boost)."""
        if slept_ms > 0.05:
            self.cycles_per_ms = cycles / slept_ms
