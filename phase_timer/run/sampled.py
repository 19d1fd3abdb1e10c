"""The steps whose boundaries do more than mark: the verdict's sampled step and the step whose FLOPs are counted.

Each is a class made over the plain boundaries' class (:func:`sampled_class`, :func:`counted_class`; the plain one
is :class:`phase_timer.run.boundaries.Boundaries`, which makes both), with its slots and no more, so that an
instance's class is swapped in for one step and back: the C boundaries serve the plain class only, and take the
methods' path while either is on.  When steps in flight are counted is here too.
"""

from __future__ import annotations

import time
from typing import Any

from phase_timer.phases import PAUSED
from phase_timer.run.own_cost import PlainSample

#: Steps in flight are counted at a close (one query at most, never a wait): at every second close of
#: the first FLIGHT_DENSE_STEPS timed steps (from the second: the first has no timed step before it),
#: then at every FLIGHT_EVERY-th.
FLIGHT_DENSE_STEPS = 32
FLIGHT_EVERY = 16
#: The boundaries a sampled step times, from entry to return (outermost only).
TIMED = ("fetch", "batch", "count_batch", "micro_batch_end", "copied", "forward", "backward_start", "backward_end",
         "optimizer_start", "step_end", "pause", "resume", "epoch_end", "drop", "finish", "enter", "exit")


def flight_gap(timed: int) -> int:
    """Closes from timed step ``timed``'s (counted) close to the next counted one."""
    return 2 if timed < FLIGHT_DENSE_STEPS else FLIGHT_EVERY


def note_autocast(ctx: dict) -> None:
    """A sampled step's forward: the loop's autocast, if any, in the run's context (a door that knows the precision
    has said it)."""
    if "autocast" not in ctx and "precision" not in ctx:
        from phase_timer.runinfo import autocast_dtype

        ctx["autocast"] = autocast_dtype(ctx.get("device_type", "cuda"))


def _pair_ns() -> int:
    """What one timed call adds to its own reading: the cheapest of a few back-to-back clock reads."""
    clock = time.perf_counter_ns
    best = 1 << 62
    for _ in range(50):
        t = clock()
        best = min(best, clock() - t)
    return best


def counted_class(plain: type) -> type:
    """The class of the step whose FLOPs are being counted (untimed), over ``plain``."""

    class _CountedBoundaries(plain):  # type: ignore[valid-type, misc]
        """The step whose FLOPs are being counted (untimed): each boundary also marks the FLOP count's phase.

        The count ends at the step's close (a batch that goes on after its first optimizer step is counted
        whole), or is dropped with the step."""

        __slots__ = ()

        def _set(self, phase: str) -> None:
            if phase != self._auto:
                self.flops.counter.mark(phase)
            super()._set(phase)

        def pause(self) -> None:
            if not self.paused:
                self.flops.counter.mark(PAUSED)
            super().pause()

        def _wake(self) -> None:
            super()._wake()
            self.flops.counter.mark(self._auto)

        def _end_count(self, keep: bool) -> None:
            self.__class__ = plain
            plan = self.flops
            flops = plan.counter.stop(drop=(PAUSED,)) if keep else plan.counter.close()
            if flops is not None:
                plan.carried[plan.counter.last_signature] = plan.carry(flops)

        def _close(self) -> None:
            self._end_count(keep=True)
            plain._close(self)  # plain from here: a sampled step may begin at this close

        def _drop(self) -> None:
            self._end_count(keep=False)
            plain._drop(self)

        def finish(self, *, interrupted: bool = False) -> None:
            self._end_count(keep=self.ended)  # a step cut off mid-way: no count
            plain.finish(self, interrupted=interrupted)

    return _CountedBoundaries


def sampled_class(plain: type) -> type:
    """The class of the verdict's sampled step, over ``plain``."""

    class _SampledBoundaries(plain):  # type: ignore[valid-type, misc]
        """A sampled step's boundaries: the same calls, each timed.

        From the close of the step before to the sampled step's own close, every call a door makes
        is timed from entry to return, outermost only: the host time phase-timer spends on the
        training thread (boundaries, marks, poll and resolve, window statistics, writes queued,
        the rank exchange).  The host time from the step's begin to its (last) end is kept too:
        the device's step over it says whether the device keeps pace with the host.
        """

        __slots__ = ()
        _PAIR_NS: int | None = None

        @classmethod
        def start(cls, bounds: Any) -> None:
            if cls._PAIR_NS is None:
                cls._PAIR_NS = _pair_ns()
            bounds.__class__ = cls
            bounds._depth = 0
            bounds._own_ns = 0
            bounds._calls = 0
            bounds._t_begin = bounds._t_end = bounds._host_ns = 0
            bounds._sample_state = None  # "closed" or "dropped" once the sample is over
            bounds._restart = False  # the gap ran out on this sample's own close: the next one starts at its end
            bounds._window0 = bounds.core.window_ns  # window ends within the sample are no step's: taken out

        def _begin(self, step: int, phase: str) -> None:
            self._t_begin = time.perf_counter_ns()
            super()._begin(step, phase)

        def step_end(self) -> None:
            if self.open:
                self._t_end = time.perf_counter_ns()
            super().step_end()
            if self.open and not self.paused:
                self.core.probe_behind()

        def _set(self, phase: str) -> None:
            marked = phase != self._auto and not self._explicit and self.open and not self.paused
            super()._set(phase)
            if marked:
                self.core.probe_behind()

        def forward(self, *, begins: bool = False) -> None:
            super().forward(begins=begins)
            if self.open:
                note_autocast(self.core.context)

        def _close(self) -> None:
            recorded = self.core.recording
            super()._close()
            self._sample_state = "closed" if recorded else "dropped"
            # Read now: with no loader the same call begins the next step (its forward), which moves _t_begin.
            self._host_ns = self._t_end - self._t_begin if self._t_begin and self._t_end > self._t_begin else 0

        def _start_sample(self) -> None:
            self._restart = True

        def _drop(self) -> None:
            super()._drop()
            self._sample_state = "dropped"

        def finish(self, *, interrupted: bool = False) -> None:
            super().finish(interrupted=interrupted)
            self._sample_state = self._sample_state or "dropped"

        def _end_sample(self) -> None:
            """Back to the plain class; a closed, recorded step's sample goes to the core."""
            state, self._sample_state = self._sample_state, None
            pair = _SampledBoundaries._PAIR_NS or 0
            own = max(0, self._own_ns - self._calls * pair - (self.core.window_ns - self._window0))
            self.__class__ = plain
            if state == "closed" and self._host_ns:
                self.core.add_sample(own, self._host_ns / 1e6)
            if self._restart:
                self._start_sample()
            elif state == "closed":  # the next ordinary step is timed as it runs, for the own-cost line (own_cost.py)
                PlainSample.start(self, pair)

    for name in TIMED:
        setattr(_SampledBoundaries, name, _timed(_SampledBoundaries.__dict__.get(name) or getattr(plain, name), name))
    return _SampledBoundaries


def _timed(inner: Any, name: str) -> Any:
    """``inner``, timed from entry to return when no other boundary call is timing it."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._depth:  # called from another boundary: the outer call times it
            return inner(self, *args, **kwargs)
        self._depth = 1
        t0 = time.perf_counter_ns()
        try:
            return inner(self, *args, **kwargs)
        finally:
            self._own_ns += time.perf_counter_ns() - t0
            self._calls += 1
            self._depth = 0
            if self._sample_state is not None:
                self._end_sample()

    method.__name__ = name
    method.__doc__ = inner.__doc__
    return method
