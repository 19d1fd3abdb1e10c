"""DDP's host-paced spans: the device caught up with the host inside DDP's end-of-backward
(:class:`PacedSpans`, which :class:`~phase_timer.measures.comm.ddp.DdpComm` takes its methods from).

Where the device catches up with the host inside the span (a host-paced backward: the device has run out of work
while the host still launches DDP's copies, ~13 µs each on an H200 host), the span also holds the device's idle
between those launches, which no collective causes and no mark separates from a wait.  Two questions a step take it
off: had the device reached the span's start when the host left the span, and had it passed the span's end when the
host reached the next optimizer step, no later after the span than the host's own time in it?  Where both say yes,
the device ran what the span holds as the host launched it, and the wait is taken as the span less the host's time
in it: the step's wait loses that host time less DDP's copies (which come off every step later), where positive, on
its own row (an ``add_host`` on the open record: ``backward`` keeps it, the phases still add up; a window and a step
line stop at zero).  A device that reached the span's start but waits, past it, for a collective that outlasts the
host's launches (a rank waiting for a slower peer) is still in the span when the host reaches its optimizer step:
nothing is taken (2 x H200, DDP, 200 parameter tensors, a peer sleeping every third step: the span's end was done at
the optimizer step on no step of those that waited 2-39 ms, and on the host-paced ones that waited ~1.5 ms).  A
device still behind the host at the span's start, caught up inside it, reads as much low.  The host's time is noted
at both ends of the span (``perf_counter_ns``), the span ends in a callback after DDP's end-of-backward; the first
question is ``engine.behind()`` asked right after that switch (one query of the span's start mark, never a wait; on
the host clock no answer, nothing taken): :meth:`PacedSpans._settle`; the second a mark queued after the span's end,
queried by torch's global optimizer step hooks (:meth:`PacedSpans._decide`), held only while the module is
host-paced (a span inside the step, a closure's backward, is asked at its post-hook).  A span whose step reaches no
optimizer step before the next span begins (a synced micro-batch) keeps its wait whole; so does one whose host took
longer after it than its own time in it to reach the step (a sync before the step: ``GradScaler.step``'s inf check,
a logged ``loss.item()``; or the loop's own work): such a host finds the span done either way, a rank that waited
for its peer included, so the answer tells nothing (a host-paced device is done at once).  An asked backward costs a
Python frame at each end, two marks and two queries (each ``cuEventQuery`` ~12 µs of host time on an H100 host: the
driver submits the queued work) and two frames an optimizer step: ~60 µs of host time against the usual path's ~8
(``benchmarks/comm_truth.py``, ``docs/benchmarks.md``).  Every host-paced backward is asked: skipping the questions
on a steadily host-paced module saves ~12 µs of that (2 x H200) and reads a wait on a skipped backward (a peer late
once, a device fallen behind, a host late to its optimizer step) low by the span's host time, ~2 ms on 200 parameter
tensors.  The span ends after DDP's end-of-backward: ended at backward's return, it would also hold the host's time
from there to that return, where the device idles (0.8-2.0 ms a step over the blocked rule on 2 x H200,
``comm_nccl.py``'s ``host200``).  On a device the module asks from its first synced backward (no used-parameter map
read inside the span, both questions askable), so a rank whose steps turn host-paced later in the run (a loaded
host, a peer's lag that comes and goes) has them corrected; a device-bound loop, whose host is further ahead at the
span's start than its own time in the span, answers "behind", and ``PACED_OFF`` such answers in a row turn the usual
path back into the engine's own switch (no Python frame).  Off, a sampled backward's copies whose last bucket the
device had caught up with (every wait was over before the host had launched the copies; a rank whose device waits
for its peers is still in a wait there) turn it on again, or, with no copies to time (bucket views), the answer
itself on a span that ends in Python anyway (a sampled backward's, a composed hook's).  A sample whose last bucket's
copies queued takes nothing and turns nothing.  Never under ``find_unused_parameters``: DDP reads its used-parameter
map on the host inside the span.  A device-bound loop's wait is the span, as without the questions.

Why it matters beside DDP's copies: on a host-paced step the device runs the copies at the pace of their launches
(3-5x their own time, 200 small copies on 2 x H200), and the span less the host's time takes that pace off whole;
the copies' estimate taken off every step (``run.RunComm``) is their own time alone (``copies.Copies.own``), which is
what a step whose device is behind or waiting spends on them.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from phase_timer._env import warn

from phase_timer.measures.comm.run import WAIT
from phase_timer.phases import BACKWARD

try:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
except ImportError:  # torch without global optimizer hooks: no second question, nothing taken
    register_optimizer_step_pre_hook = register_optimizer_step_post_hook = None

try:
    from phase_timer._native import Arm
except ImportError:  # not built: the parameter's hook is a Python call
    Arm = None

log = logging.getLogger(__name__)

#: A host-paced module's wait start is a Python callback (the span's host time noted at both ends) until this many
#: synced backwards in a row on which the device had not reached the span's start when the host left it.
PACED_OFF = 64


class PacedSpans:
    """The host-paced path of a DDP module's split: its wait's start and end in Python, the one question a step, and
    the switch between that path and the engine's own (the state is :class:`~phase_timer.measures.comm.ddp.DdpComm`'s)."""

    def _paced_start(self) -> None:
        """The wait begins on the paced path (the usual path's start while the module asks, :meth:`_pace`): the last
        span's question, unasked, dropped (its wait whole); the switch to the wait; the host time noted; its end
        queued after DDP's end-of-backward (queued before this one ran)."""
        engine = self._engine
        if engine is None:
            return
        if self._deferred is not None:
            self._drop_deferred()
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

    def _settle(self, engine: Any, h1: int, kept_up: bool | None = None) -> list[Any] | None:
        """The span has just ended (the engine switched out of it; the host entered it at ``_h0`` and left it at
        ``h1``): had the device reached its start by then?  ``engine.behind()`` right after the switch asks exactly
        that (one query of the span's start mark, never a wait; None on the host clock: nothing taken).

        Where it had, on a module seen to be host-paced, the device ran the span's work as the host launched it,
        idle between DDP's launches (its copies, ~13 µs each), which no collective causes, unless it then waited for
        a collective past the host's launches: the second question, :meth:`_decide`'s at the next optimizer step,
        tells the two apart.  Where the device had also reached the span's end by then, the wait is taken as the
        span less the host's time in it: the step's wait loses the host's time less the module's copies (taken
        off every step later, ``run.take_copies``), where that is positive: ``engine.add_host(WAIT, -ms)`` on the
        open record, summed into the wait's own row by both engines, not into ``backward``'s.  A device still
        behind at the span's start reads as much low (a window and a step line stop at zero).

        The module asks from its first synced backward on a device; ``PACED_OFF`` answers "behind" in a row turn
        the usual path's start back into the engine's own switch (:meth:`_pace`).  Off, a sampled backward's copies
        whose last bucket the device had caught up with (``kept_up``: every wait was over before the host had
        launched the copies, where a rank that waits for its peers has its device still in a wait) turn it on; a
        module whose copies are never timed (bucket views), the answer itself on a span that ends in Python anyway
        (a sampled backward's, a composed hook's).  ``kept_up`` False (the last bucket's copies queued: the device
        still in a wait when the host had launched them) takes nothing.  Never under ``find_unused_parameters``: DDP reads its used-parameter map on the
        host inside the span, whose host time then holds the device's wait.  Returns what :meth:`_defer` holds for
        the second question (None: nothing to take)."""
        h0, self._h0 = self._h0, None
        if h0 is None or kept_up is None and self._copying and not self._paced:
            return None  # off: a module whose copies are timed is turned on by a sample of them alone
        behind = engine.behind() if not self._find_unused() else None
        if behind is None:
            return None
        if behind:
            if kept_up is None:  # the device behind its host: this span's copies queued (DdpComm._resample)
                self._resample()
            if self._paced:
                self._cold += 1
                if self._cold >= PACED_OFF:
                    self._pace(False)
            return None
        if kept_up is False:  # the last bucket's copies queued: the device waited past the host's launches
            self._cold = 0
            return None
        if not self._paced:  # a sample caught up, or (bucket views) the answer itself: on, where it can be asked
            if not self._asking:
                return None
            self._pace(True)
        self._cold = 0
        host_ms = (h1 - h0) / 1e6
        ms = self._own_ms(host_ms)
        return self._defer(ms, h1, host_ms) if ms > 0 else None

    def _defer(self, ms: float, h1: int, host_ms: float) -> list[Any] | None:
        """The second question (:meth:`_decide`): a mark queued now, after the span's end (the host left it at
        ``h1``, having spent ``host_ms`` in it), and ``ms`` to take if the device has passed it when the host reaches
        the optimizer step; at its pre-hook, or, for a span inside that step (a closure's backward: Lightning's
        automatic optimization, ``LBFGS``), at its post-hook.  Held as ``[mark, ms, taken]``, taken None until
        decided (a sample's exposed wait, :meth:`DdpComm._resolve`, waits for it)."""
        core = self._core
        if core is None or not self._asking:
            return None
        if self._opt_hooks is None:
            self._opt_hooks = _hook_optimizers(self)
        clock = core.clock
        held = [clock.mark(), ms, None]
        self._deferred = (held, clock, self._in_step, h1, host_ms)
        return held

    def _at_optimizer(self, post: bool) -> None:
        """A global optimizer step hook, held while the module is host-paced: the pre-hook asks a span's question
        from before the step and notes that a step runs; the post-hook asks one from inside it (a closure's).  A
        failure (a query on a device in error) warns, asks no more and takes nothing: the step goes on."""
        self._in_step = not post
        deferred = self._deferred
        if deferred is None or deferred[2] != post:
            return
        try:
            self._decide()
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            # the hooks stay, no-ops, until the path turns (torch is going through its global hooks: no removal)
            self._asking = False
            try:
                warn(log, f"phase-timer: a host-paced wait is no longer corrected ({type(err).__name__}: {err}); "
                          "backward.comm_wait holds the whole span from here", 4)
            except Exception:  # noqa: BLE001 - warnings turned into errors: still never into the step
                pass

    def _decide(self) -> None:
        """Had the device passed the span's end when the host reached this optimizer step (one query, never a
        wait)?  Yes, with the host there no later after the span than its own time in the span: the host-paced
        span's wait loses the host's time in it, on the record still open.  No: the device was still in the span,
        waiting for a collective: nothing is taken (``paced_waiting``).  A host that took longer than the span's own
        time to reach the step (a sync before it: ``GradScaler.step``'s inf check, a logged ``loss.item()``; or
        the loop's own work) would find the span done either way, a device that waited for a peer's collective
        included: that answer tells nothing, and nothing is taken (``paced_waiting``) -- a host-paced device is done
        at once, where a rank waiting for its peer is not.  A device still in the span may have DDP's copies sampled
        on the next synced backward (``DdpComm._resample``)."""
        reached = time.perf_counter_ns()
        (held, clock, _, h1, host_ms), self._deferred = self._deferred, None
        held[2] = 0.0  # decided, whatever follows (a sample's exposed wait never waits on a failed question)
        try:
            done = clock.done(held[0])
        finally:
            clock.release([held[0]])
        engine, ms = self._engine, held[1]
        if engine is None:
            return
        if not done or (reached - h1) / 1e6 > host_ms:
            self.paced_waiting += 1
            if not done:  # the device waits in the span: its copies queue (DdpComm._resample)
                self._resample()
            return
        self._take(engine, ms)
        held[2] = ms

    def _drop_deferred(self) -> None:
        """A span begins (or the binding changes) with the last one's question unasked (no optimizer step since):
        its wait stays whole."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            held, clock = deferred[0], deferred[1]
            held[2] = 0.0
            clock.release([held[0]])

    def _pace(self, on: bool) -> None:
        """The usual path's start from the next synced backward: a Python callback that notes the span's host time
        (``on``), or the engine's own switch."""
        self._paced, self._cold = on, 0
        self._set_start(self._paced_start if on else self._to_wait)
        if not on:
            self._unhook_optimizer()

    def _set_start(self, start: Any) -> None:
        """The usual path's start from the next synced backward: ``start`` (the Arm's callback, or what
        ``DdpComm._began`` queues)."""
        self._start = start
        if Arm is not None and isinstance(self._armed, Arm):
            self._armed.callback = start

    def _own_ms(self, host_ms: float) -> float:
        """What a span's wait can lose: the host's time in it less the module's copies' median estimate (it comes off
        every step; a step left with more than ``run.WAITED_MS`` loses each bucket's quickest sample instead, and reads
        high by the difference: ``run.less_copies``)."""
        run = self._run
        return host_ms - (run.module_copy_ms(self) if run is not None else 0.0)

    def _take(self, engine: Any, ms: float) -> None:
        """The span's wait loses ``ms`` of host time, on the record still open (its own row, not ``backward``'s)."""
        engine.add_host(WAIT, -ms)
        self.paced_steps += 1
        self.paced_ms += ms

    def _unhook_optimizer(self) -> None:
        """The global optimizer hooks off (the last question, if any, unasked: that wait stays whole)."""
        self._drop_deferred()
        hooks, self._opt_hooks, self._in_step = self._opt_hooks, None, False
        for handle in hooks or ():
            handle.remove()


def _hook_optimizers(spans: PacedSpans) -> tuple[Any, Any]:
    """Torch's global optimizer step pre- and post-hooks for ``spans``, holding it weakly: a module whose timer is
    never closed is not kept alive by torch's global hook table (a dead one's hooks do nothing)."""
    ref = weakref.ref(spans)

    def pre(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live._at_optimizer(False)

    def post(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live._at_optimizer(True)

    return register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)
