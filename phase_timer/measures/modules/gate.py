"""Which module's gate (CUDA): the side stream's sleep that holds a sample's kernels until they are queued, sized per
group from what its last sample read needed (``docs/modules.md``)."""

from __future__ import annotations

import time
from typing import Any

import torch

#: CUDA: a sample's gate (``_Gate``), per group: the run's first one's length without the host's time of the step
#: before (GATE_FIRST_MS; with it, that times GATE_MARGIN plus GATE_PAD_MS); then, from the group's last sample read,
#: the sleep that would have left every mark queued in time (the host's time to each mark less the device's time
#: known to be its own before it, at most) times GATE_MARGIN plus GATE_PAD_MS, within
#: [GATE_MIN_MS, GATE_MAX_MS] and never past the run's median step period (times the margin, plus the pad) once a
#: window has been read; the SM clock's rate assumed until a sleep is measured (cycles a ms).  (Whether a sample
#: has a gate at all: ``times.GATE``.)
GATE_FIRST_MS = 10.0
GATE_MARGIN = 1.25
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
        self.ms: float | None = None  # the last length sized (a group not yet read takes it); None: none sized yet
        self.by_group: dict[int, float] = {}
        self.cap = GATE_MAX_MS  # lowered to the run's step period (with the margin) once a window is read
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
        ms = self.by_group.get(group, self.ms)
        if ms is None:
            ms = GATE_FIRST_MS if host_ms is None else max(GATE_MIN_MS, host_ms * GATE_MARGIN + GATE_PAD_MS)
        return min(self.cap, ms)

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
        difference or more, the group is :attr:`futile`."""
        last = self.last.get(group)
        self.last[group] = (slept_ms, host_ms, late)
        if late and last is not None and last[2]:
            more = slept_ms - last[0]
            if more >= 1.0 and host_ms - last[1] >= more / 2:
                self.futile.add(group)
        want = need_ms * GATE_MARGIN + GATE_PAD_MS
        self.ms = self.by_group[group] = min(self.cap, max(GATE_MIN_MS, want))
        self.capped += want > self.cap

    def bound(self, period_ms: float) -> None:
        """No gate longer than the run's step period with the margin: within a step the host cannot fall further
        behind the device than the step's own time (the margin is for the hooks' host time), and a longer sleep would
        only be waited for (a sync inside the step waits for it, whatever its length)."""
        if period_ms > 0:
            self.cap = min(GATE_MAX_MS, max(GATE_MIN_MS, period_ms * GATE_MARGIN + GATE_PAD_MS))

    def calibrate(self, slept_ms: float, cycles: int) -> None:
        """The SM clock's rate from a sleep's measured length (the device's clock moves with its boost)."""
        if slept_ms > 0.05:
            self.cycles_per_ms = cycles / slept_ms
