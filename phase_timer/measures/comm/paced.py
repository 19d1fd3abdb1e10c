"""DDP's host-paced spans: the device caught up with the host inside DDP's end-of-backward
(:class:`PacedSpans`, which :class:`~phase_timer.measures.comm.ddp.DdpComm` takes its methods from).

Where the device catches up with the host inside the span (a host-paced backward: the device has run out of work
while the host still launches DDP's copies, ~13 µs each on an H200 host), the span also holds the device's idle
between those launches, which no collective causes and no mark separates from a wait.  One question a step takes
it off: had the device reached the span's start when the host left the span?  Where it had, on a module seen to be
host-paced, the device ran what the span holds as the host launched it, and the wait is taken as the span less
the host's time in it: the step's wait loses that host time less DDP's copies (which come off every step later),
where positive, on its own row (an ``add_host`` on the open record: ``backward`` keeps it, the phases still add
up; a window and a step line stop at zero).  A device still behind the host at the span's start, caught up inside
it, reads as much low; so does one that, past the span's start, waits for a collective that outlasts the host's
launches.  The host's time is noted at both ends of the span (``perf_counter_ns``), the span ends in a callback
after DDP's end-of-backward, and the question is ``engine.behind()`` asked right after that switch (one query of
the span's start mark, never a wait; on the host clock no answer, nothing taken): :meth:`PacedSpans._settle`.  That
costs a Python frame at each end, a mark and a query a backward (~2 µs of Python on a CPU core), so the usual path
keeps the engine's own switch until the module is seen host-paced: by a sampled backward's copies whose last
bucket the device had caught up with (every wait was over before the host had launched the copies; a rank whose
device waits for its peers is still in a wait there), or, with no copies to time (bucket views), by the answer
itself on a span that ends in Python anyway (a sampled backward's, a composed hook's).  Then the module's start is
the Python one, until a sample says otherwise or ``PACED_OFF`` backwards in a row find the device behind.  Never
under ``find_unused_parameters``: DDP reads its used-parameter map on the host inside the span.  A device-bound
loop, whose host is further ahead at the span's start than its own time in the span, never answers caught up: its
wait is the span, as without the question.
"""

from __future__ import annotations

import time
from typing import Any

from phase_timer.measures.comm.run import WAIT
from phase_timer.phases import BACKWARD

try:
    from phase_timer._native import Arm
except ImportError:  # not built: the parameter's hook is a Python call
    Arm = None

#: A host-paced module's wait start is a Python callback (the span's host time noted at both ends) until this many
#: synced backwards in a row on which the device had not reached the span's start when the host left it.
PACED_OFF = 64


class PacedSpans:
    """The host-paced path of a DDP module's split: its wait's start and end in Python, the one question a step, and
    the switch between that path and the engine's own (the state is :class:`~phase_timer.measures.comm.ddp.DdpComm`'s)."""

    def _paced_start(self) -> None:
        """The wait begins on a host-paced module (the usual path's start once :meth:`_settle` saw the device catch
        up): its host time is noted, and its end queued after DDP's end-of-backward."""
        engine = self._engine
        if engine is None:
            return
        engine.switch(WAIT)
        self._h0 = time.perf_counter_ns()
        self._queue_callback(self._paced_end)

    def _paced_end(self) -> None:
        """After DDP's end-of-backward, on a host-paced module: the wait ends here (nothing is enqueued between
        this and backward's return, so its end does not move on the device)."""
        h1 = time.perf_counter_ns()
        engine = self._engine
        if engine is None or engine.current != WAIT:
            return
        engine.switch(BACKWARD)
        self._settle(engine, h1)

    def _settle(self, engine: Any, h1: int, kept_up: bool | None = None) -> float:
        """The span has just ended (the engine switched out of it; the host entered it at ``_h0`` and left it at
        ``h1``): had the device reached its start by then?  ``engine.behind()`` right after the switch asks exactly
        that (one query of the span's start mark, never a wait; None on the host clock: nothing taken).

        Where it had, on a module seen to be host-paced, the device ran the span's work as the host launched it,
        idle between DDP's launches (its copies, ~13 µs each), which no collective causes: the wait is taken as the
        span less the host's time in it.  So the step's wait loses the host's time less the module's copies (taken
        off every step later, ``run.take_copies``), where that is positive: ``engine.add_host(WAIT, -ms)`` on the
        open record, summed into the wait's own row by both engines, not into ``backward``'s.  A device still
        behind at the span's start reads as much low, and so does one that waits, after reaching it, for a
        collective that outlasts the host's launches (a window and a step line stop at zero).

        A module is seen host-paced (the usual path's start turns Python, :meth:`_pace`) by a sampled backward's
        copies whose last bucket the device had caught up with (``kept_up``: every wait was over before the host
        had launched the copies, where a rank that waits for its peers has its device still in a wait); a module
        whose copies are never timed (bucket views), by the answer itself on a span that ends in Python anyway (a
        sampled backward's, a composed hook's).  ``kept_up`` False turns it off at once, and so do ``PACED_OFF``
        answers "behind" in a row.  Never under ``find_unused_parameters``: DDP reads its used-parameter map on the
        host inside the span, whose host time then holds the device's wait.  Returns the ms taken (0.0: none)."""
        h0, self._h0 = self._h0, None
        if h0 is None or kept_up is None and self._copying and not self._paced:
            return 0.0  # nothing to ask: a module whose copies are timed is turned on by a sample of them alone
        behind = engine.behind() if not self._find_unused() else None
        if behind is None:
            return 0.0
        if kept_up is not None:  # a timed sample of the copies decides, on or off
            if kept_up != self._paced:
                self._pace(kept_up)
            if not kept_up:
                return 0.0
        elif behind:
            if self._paced:
                self._cold += 1
                if self._cold >= PACED_OFF:
                    self._pace(False)
            return 0.0
        elif not self._paced:  # bucket views (no copies to time): the answer itself turns it on
            self._pace(True)
        self._cold = 0
        run = self._run
        ms = (h1 - h0) / 1e6 - (run.module_copy_ms(self) if run is not None else 0.0)
        if ms <= 0:
            return 0.0
        engine.add_host(WAIT, -ms)
        self.paced_steps += 1
        self.paced_ms += ms
        return ms

    def _pace(self, on: bool) -> None:
        """The usual path's start from the next synced backward: a Python callback that notes the span's host time
        (``on``), or the engine's own switch."""
        self._paced, self._cold = on, 0
        self._start = self._paced_start if on else self._to_wait
        if Arm is not None and isinstance(self._armed, Arm):
            self._armed.callback = self._start
