"""phase-timer's own host time a step: what an ordinary step pays, plus the sampled work amortized.

The verdict's sampled steps (``run/sampled.py``) time every boundary call, but they
are no ordinary step: they go through the Python methods, not the C path an ordinary step takes
(``_native.Fast``), under a swapped class that the interpreter's specialized attribute reads miss;
they probe the device at each phase change (one event query each) and read the autocast state.
On the CPU machine's hot loop a sampled step measured ~12-15 µs where an ordinary one costs ~3
(``benchmarks/host_cost.py``); on an H100 the line read 140-830 µs a step where the hooks' own
time is ~55 (``docs/benchmarks.md``).  So their time is the cost of sampling, not of a step.

An ordinary step is measured apart: the step after each sampled one (or the next that is neither
a memory step nor sampled, within :data:`TRIES`) is timed through the very path it takes -- each
call the doors make (the boundaries' ``on_*`` hooks, C where built, and their Python methods),
entry to return, outermost only, less the clock read's own cost -- by wrappers put on the instance
for that one step and taken off at its close.  Window ends (statistics, the CPU readings, writes
queued, the ranks' exchange) are timed on every window (``TimingCore.window_ns``) and taken out of
both kinds of sample, then spread over the steps, so a window that falls in a sample counts once.

The estimate (:func:`estimate`): the median ordinary step, plus window ends, the sampled steps'
extra over an ordinary one and memory's reads, each amortized over the steps begun.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: Steps tried at most for one ordinary sample: a memory step, a pause or a dropped batch is no ordinary step.
TRIES = 4
#: What the doors call on the boundaries: the hot hooks (instance slots, C where built) ...
HOT = ("on_fetch", "on_batch", "on_forward", "on_copied", "on_backward_start", "on_backward_end",
       "on_optimizer_start", "on_step_end")
#: ... and the methods some doors call directly (the 🤗 door, Lightning's iteration mode, user phases, a scaler).
#: Where the sample is found on the instance while its wrappers are on.
SAMPLE_KEY = "_plain_sample"
DIRECT = ("fetch", "batch", "micro_batch_end", "copied", "forward", "backward_start", "backward_end",
          "optimizer_start", "step_end", "pause", "resume", "epoch_end", "drop", "enter", "exit")


class PlainSample:
    """One ordinary step's own host time, through the path it takes: wrappers on the instance for one step."""

    __slots__ = ("bounds", "plain", "pair_ns", "put", "before", "active", "depth", "own", "calls", "dirty",
                 "closes", "begun", "window0", "tries")

    def __init__(self, bounds: Any, pair_ns: int) -> None:
        self.bounds, self.plain, self.pair_ns = bounds, type(bounds), pair_ns
        self.active, self.depth, self.tries = True, 0, 0
        self._reset()
        own = vars(bounds)
        #: What each name held before (a hook; the instance's own entry, or None: the class's method) ...
        self.before: dict[str, Any] = {name: getattr(bounds, name) for name in HOT}
        self.before.update({name: own.get(name) for name in (*DIRECT, "finish")})
        #: ... and what this sample put there (taken off only where it is still there).
        self.put: dict[str, Any] = {name: self._timed(getattr(bounds, name)) for name in (*HOT, *DIRECT)}
        self.put["finish"] = self._finish(getattr(bounds, "finish"))
        for name in HOT:
            setattr(bounds, name, self.put[name])
        for name in (*DIRECT, "finish"):  # a wrapper of the user's (a benchmark's) stays in the path
            own[name] = self.put[name]
        # Found here by a step that swaps the class (a FLOP count): the methods above are the plain class's.
        own[SAMPLE_KEY] = self

    @classmethod
    def start(cls, bounds: Any, pair_ns: int) -> None:
        """Time the next ordinary step of ``bounds`` (at a close); a failure here costs the sample, not the step."""
        try:
            cls(bounds, pair_ns)
        except Exception:  # noqa: BLE001 - e.g. boundaries without the attributes read: no sample
            pass

    def _reset(self) -> None:
        b = self.bounds
        self.own = self.calls = 0
        self.dirty = False
        self.closes, self.begun, self.window0 = b.steps, b.begun, b.core.window_ns

    def _timed(self, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.depth or not self.active:  # called from another boundary (the outer call times it), or over
                return fn(*args, **kwargs)
            self.depth = 1
            self._guarded(self._look)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.own += time.perf_counter_ns() - t0
                self.calls += 1
                self.depth = 0
                self._guarded(self._after)

        return call

    def _guarded(self, check: Any) -> None:
        try:
            check()
        except Exception:  # noqa: BLE001 - a sample lost, never the step (the line falls back on the sampled steps)
            self.remove()

    def _finish(self, fn: Any) -> Any:
        def finish(*args: Any, **kwargs: Any) -> Any:
            self.remove()  # the run's end is no step's
            return fn(*args, **kwargs)

        return finish

    def _look(self) -> None:
        """Is this still an ordinary step: the plain class (no verdict sample), no memory read, no pause?"""
        b = self.bounds
        if type(b) is not self.plain or b._mem_on or b.paused:
            self.dirty = True

    def _after(self) -> None:
        b = self.bounds
        if b.steps == self.closes:
            self._look()  # a memory step begins in this call, or a pause
            return
        # A step closed in this call (a verdict sample may begin at the close: the step was ordinary all the
        # same): the sample, if it was one ordinary step from its begin to its close.
        if not self.dirty and b.begun == self.begun + 1:
            core = b.core
            own = self.own - self.calls * self.pair_ns - (core.window_ns - self.window0)
            core.signals.plain_ns.append(max(0, own))
            self.remove()
            return
        self.tries += 1
        if self.tries >= TRIES or type(b) is not self.plain:
            self.remove()
        else:
            self._reset()

    def remove(self) -> None:
        """Put back what this sample replaced (where it is still this sample's); its wrappers then only pass calls on."""
        if not self.active:
            return
        self.active = False
        b, own = self.bounds, vars(self.bounds)
        for name in HOT:
            if getattr(b, name) is self.put[name]:
                setattr(b, name, self.before[name])
        if own.get(SAMPLE_KEY) is self:
            del own[SAMPLE_KEY]
        for name in (*DIRECT, "finish"):
            if own.get(name) is self.put[name]:
                if self.before[name] is None:
                    del own[name]
                else:
                    own[name] = self.before[name]


def _median_ns(values: list[int]) -> float | None:
    return float(statistics.median(values)) if values else None


def estimate(*, plain_ns: list[int], sampled_ns: list[int], window_ns: int, steps: int, sample_gap: float | None,
             memory_ns: int | None = None, memory_steps: int = 0, memory_gap: float = 1.0) -> dict[str, Any] | None:
    """The own-cost figures (µs) from a run's samples; None before a verdict sample.

    ``plain_ns``: ordinary steps' own time; ``sampled_ns``: the verdict's sampled steps' (both less
    window ends); ``window_ns``: every window end's; ``memory_ns``: memory's (None: not read) over
    ``memory_steps`` memory steps (the Memory measure's ``cost``); ``steps``: steps begun; the gaps: the sparse
    schedules' means (the long run's rates; no ``sample_gap``: no long-run figure).  With no ordinary step
    measured, the sampled steps stand for one: an upper bound.
    """
    if not sampled_ns or steps <= 0:
        return None
    sampled = statistics.fmean(sampled_ns)
    ordinary = _median_ns(plain_ns)
    basis = ordinary if ordinary is not None else sampled
    windows = window_ns / steps
    sampling = max(0.0, sum(sampled_ns) - len(sampled_ns) * basis) / steps
    memory = memory_ns / steps if memory_ns is not None else None
    total = basis + windows + sampling + (memory or 0.0)
    per_memory_step = memory_ns / memory_steps if memory_ns is not None and memory_steps else 0.0
    long_run = (basis + windows + max(0.0, sampled - basis) / sample_gap + per_memory_step / memory_gap
                if sample_gap else None)
    us = 1e-3
    return {
        "us_per_step": total * us,
        "ordinary_us": ordinary * us if ordinary is not None else None,
        "ordinary_samples": len(plain_ns),
        "sampled_us": sampled * us,
        "windows_us_per_step": windows * us,
        "sampling_us_per_step": sampling * us,
        "memory_us_per_step": memory * us if memory is not None else None,
        "long_run_us_per_step": long_run * us if long_run is not None else None,
        "steps": steps,
    }


def run_figures(core: Any) -> dict[str, Any] | None:
    """A run's own-cost figures (``TimingCore.own_cost``): :func:`estimate` over its samples and what its measures
    spend of their own, with the share of ``period`` and whether the host ran ahead; None before a sampled step."""
    sig, spent = core.signals, {}
    for measure in core.measures:  # what each spends of its own (memory's reads)
        spent.update(measure.cost())
    own = estimate(plain_ns=sig.plain_ns, sampled_ns=sig.own_ns, window_ns=core.window_ns, steps=core.steps_begun,
                   sample_gap=sig.sample_gap, **spent)
    if own is None:
        return None
    period = core.totals.phases.get("period")
    own["share_of_period"] = own["us_per_step"] / 1e3 / period.mean if period is not None and period.mean > 0 else None
    own["samples"] = len(sig.own_ns)
    own["host_ahead"] = host_ahead(sig.flight)
    return own


def host_ahead(flight: Any) -> bool | None:
    """The host ran a step or more ahead of the device at most sampled closes (``flight``: the closes counted by
    steps in flight; None: none counted)."""
    n = sum(flight.values())
    if not n:
        return None
    return n - flight[0] > n / 2
