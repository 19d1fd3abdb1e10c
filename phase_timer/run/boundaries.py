"""What each boundary of a training step means: the one definition of every phase, for both doors.

The doors only report what happened -- a batch was fetched, the forward started, ``backward()`` was called, an
optimizer stepped -- and :class:`Boundaries` turns that into marks on the core.  So a phase means the same whichever
door measured it (the README's metric table says what each one holds).

A step ends *provisionally* at each optimizer step's end: if the same batch goes on (a second optimizer, SAM's
second pass, a GAN's generator) the step continues, and the code in between is ``forward`` (or ``optimizer`` when
the next boundary is another optimizer step).  The record closes when the next batch is fetched.  Evaluation and
validation pause the record: paused spans are nobody's time.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from phase_timer._env import native_wanted, warn_once
from phase_timer.run.core import TimingCore
from phase_timer.timing.engine import POLL_EVERY
from phase_timer.signature import signature
from phase_timer.phases import BACKWARD, BETWEEN, FETCH, FORWARD, H2D, IDLE, OPTIMIZER, PAUSED, after_end
from phase_timer.run.batch_counts import BatchCounts
from phase_timer.run.census_steps import CensusSteps
from phase_timer.run.memory_steps import MemorySteps
from phase_timer.run.module_steps import ModuleSteps
from phase_timer.run.own_cost import SAMPLE_KEY
from phase_timer.run.sampled import FLIGHT_DENSE_STEPS, FLIGHT_EVERY  # noqa: F401 - the tests read them here
from phase_timer.run.sampled import counted_class, flight_gap, sampled_class

try:
    from phase_timer._native import Fast as _Fast
except ImportError:  # not built: the doors call the methods themselves
    _Fast = None

log = logging.getLogger(__name__)


#: The verdict's samples come densely at first, so that a profile of 20-100 steps gets a verdict,
#: then sparsely, so that a long run pays next to nothing for them (``docs/diagnosis.md``).
#:
#: A *sampled* step: phase-timer times its own host work on it, and the host's time to issue it.
#: The first DENSE_SAMPLES timed steps sampled come DENSE_GAP apart (the first by timed step 4, all
#: eight by timed step 32), then one in ~96 (SAMPLE_GAP apart, at random so that no periodic work
#: aliases with them).  The other steps pay a countdown.
DENSE_SAMPLES = 8
DENSE_GAP = (2, 4)
SAMPLE_GAP = (48, 144)


def sample_gap(rng: random.Random, samples: int) -> int:
    """Closes from a sampled step to the next, after ``samples`` sampled steps were started."""
    return rng.randint(*(DENSE_GAP if samples < DENSE_SAMPLES else SAMPLE_GAP))


def ending_at(update: Any, bounds_now: Any) -> Any:
    """A GradScaler's ``update`` that ends the step after it (``bounds_now()``'s, unless None): the only end of a
    step the scaler skipped for inf/nan, where no optimizer step ran.  Both doors put it on their scaler."""

    def scaler_update(*args: Any, **kwargs: Any) -> Any:
        out = update(*args, **kwargs)
        bounds = bounds_now()
        if bounds is not None:
            bounds.step_end()
        return out

    return scaler_update


class Boundaries(BatchCounts, MemorySteps, CensusSteps, ModuleSteps):
    """One run's step state: the boundaries the doors report, turned into the core's marks.

    What a batch holds (:class:`BatchCounts`), a memory step's reads (:class:`MemorySteps`), the sync census's
    starts and stops (:class:`CensusSteps`) and a modules' sample's hooks (:class:`ModuleSteps`) are mixed in;
    the verdict's sampled step and the FLOP count's step take another class for one step (``run/sampled.py``)."""

    # Slots: every boundary reads and writes several of these, a few µs a step in a real loop (and the
    # sampled class, swapped in and out, has the same layout).  ``__dict__``: a benchmark times a method by
    # putting a wrapper on the instance.
    __slots__ = (
        "core", "no_end_hint", "begun", "open", "ended", "trailing", "paused", "in_backward", "steps", "_auto",
        "_explicit", "_after_backward", "_saw_forward", "_saw_backward", "_failed", "_fetched", "_warned",
        "_flight_at", "_rng", "_samples", "_sample_in", "_step",
        "_mem", "_mem_on", "_mem_due",  # a memory step's (MemorySteps)
        "_census", "_census_at",  # the sync census's (CensusSteps)
        "_mods", "_mod_on", "_mod_after", "_mod_due",  # a modules' sample's (ModuleSteps)
        "counter", "flops",  # what counts a batch (BatchCounts)
        # a sampled step's (run/sampled.py)
        "_depth", "_own_ns", "_calls", "_t_begin", "_t_end", "_host_ns", "_sample_state", "_restart", "_window0",
        # what the doors call inside a step (see `_hot`)
        "on_fetch", "on_batch", "on_forward", "on_copied", "on_backward_start", "on_backward_end",
        "on_optimizer_start", "on_step_end",
        "__dict__",
    )
    #: The slots the C boundaries (``_native.Fast``) read and write, by these names in the order of
    #: ``native/fast.c``'s enum (it takes their offsets from this tuple when it is made).
    FAST_SLOTS = ("open", "ended", "trailing", "paused", "in_backward", "_auto", "_explicit", "_after_backward",
                  "_saw_forward", "_saw_backward", "_failed", "_mem_on", "_fetched", "steps", "begun", "_step",
                  "_flight_at", "_census_at", "_sample_in", "_mem", "_mem_due", "core", "_mod_on", "_mod_due")
    #: The slots the plain door's C hooks (``_native.LoopHooks``) read, in the order of ``native/loop_hooks.c``'s.
    HOOK_SLOTS = ("on_fetch", "on_batch", "on_forward", "on_backward_start", "on_backward_end", "on_step_end",
                  "in_backward")

    def __init__(self, core: TimingCore, *, no_end_hint: str = "") -> None:
        self.core = core
        #: What to tell a user whose steps begin but never end (the door knows what ends them).
        self.no_end_hint = no_end_hint
        #: Steps begun so far (warm-up and skipped ones too).
        self.begun = 0
        #: A step has begun and its record is not closed (warm-up and skipped steps too).
        self.open = False
        #: The step has ended (at its last optimizer step so far): the next fetch closes the record.
        self.ended = False
        #: What runs now is after that end: between steps, unless the batch goes on.
        self.trailing = False
        #: The record is paused (evaluation, validation, an epoch's end).
        self.paused = False
        #: Inside the loop's ``backward()``: forwards now are recomputation (checkpointing), backward's.
        self.in_backward = False
        #: Steps closed so far: the plain door's step index.
        self.steps = 0
        self._auto = H2D  # the built-in phase the boundaries say runs now
        self._explicit: list[str] = []  # user phases open, innermost last: they own the time
        self._after_backward = False  # since the last backward: provisional `optimizer`
        self._saw_forward = self._saw_backward = False
        self._failed = False  # the last backward raised: a batch that never steps after it is dropped
        self._fetched = False  # a fetch was reported since the last batch
        self._warned: set[str] = set()
        # The verdict's samples, in closes (warm-up ones included: the schedule counts timed steps).
        warmup = core.warmup_steps
        self._flight_at = warmup + 2  # the close (1-based) at which steps in flight are next counted
        self._rng = random.Random()
        self._samples = 0  # sampled steps started
        self._sample_in = warmup + sample_gap(self._rng, 0) - 1  # closes until the next sampled step begins
        core.signals.sample_gap = sum(SAMPLE_GAP) / 2  # what a long run pays for them (the own-cost line)
        self._plan_memory(core)  # memory (CUDA only): a memory step reads the allocator at each boundary
        self._step = 0  # the step index the door gave the last step begun
        self._plan_census(core, warmup)  # the sync census (device clock): on the last warm-up step
        self._plan_modules(core)  # which module: hooks on the model on its sampled steps
        self._find_counts(core)  # what counts each batch: throughput's counter and the FLOP plan
        self._hot(core._engine)

    def _hot(self, engine: Any, native: bool = True) -> None:
        """What the doors call at each step's boundaries: ``on_fetch()``, ``on_batch(step, data_wait_ms[,
        sync_wait_ms])`` (a step that begins with ``h2d``), ``on_forward()`` (a loop with a loader),
        ``on_copied()``, ``on_backward_start()``, ``on_backward_end(failed)``, ``on_optimizer_start()``,
        ``on_step_end()``.  In C where it is built (``_native.Fast``: the usual case in one call on this
        object's own slots, its core's and ``engine``, every other case through the methods), else the methods.
        In a real loop a boundary through Python costs a few µs of frames and attributes (``docs/benchmarks.md``)."""
        fast = None
        if native and _Fast is not None and native_wanted() and type(self) is Boundaries:
            fast = _Fast(self, engine, (FORWARD, BACKWARD, OPTIMIZER, BETWEEN, H2D, "data_wait", "sync_wait"), time,
                         flight_gap, POLL_EVERY)
        if fast is not None:
            self.on_fetch, self.on_batch = fast.fetch, fast.batch
            self.on_forward, self.on_copied, self.on_step_end = fast.forward, fast.copied, fast.step_end
            self.on_backward_start, self.on_backward_end = fast.backward_start, fast.backward_end
            self.on_optimizer_start = fast.optimizer_start
        else:  # looked up at each call: a sampled step's class has its own (timed) methods
            self.on_fetch, self.on_batch = lambda: self.fetch(), lambda *a: self.batch(*a)
            self.on_forward, self.on_copied = lambda: self.forward(), lambda: self.copied()
            self.on_backward_start, self.on_optimizer_start = lambda: self.backward_start(), lambda: self.optimizer_start()
            self.on_backward_end, self.on_step_end = lambda failed: self.backward_end(failed=failed), lambda: self.step_end()

    # -- the step -------------------------------------------------------------------
    def fetch(self) -> None:
        """The loop asks for the next batch: a step that has ended is closed here.

        A batch whose backward raised and that never stepped ("skip the batch on error")
        is dropped, so that the next step is timed as if nothing had happened.  A second
        report before the batch arrives (Lightning's broadcast, then its fetch) changes nothing.
        """
        if self.paused:
            self._wake()
        if self._fetched:
            return
        self._fetched = True
        if self.ended:
            self._close()
        elif self.open and self._failed:
            self._drop()
        elif self.open:  # accumulating: the fetch is data_wait's, not the step's (as between steps), and the period's
            self.micro_batch_end()
            if not self._explicit:
                self.core.phase(FETCH)

    def batch(self, step: int | None = None, data_wait_ms: float | None = None, sync_wait_ms: float = 0.0,
              *, first: str = H2D) -> None:
        """A batch was handed over: a step begins with ``h2d``, or the open one takes another micro-batch.

        ``step``: the index to log the step at (default: steps closed so far).
        ``data_wait_ms``: the host's wait for this batch (``None``: not measured).
        ``first``: ``forward`` when the loop itself copies the batch inside the step (no ``h2d``).
        """
        if not self._fetched:  # the door reported no fetch: what it would have done
            self.fetch()
        self._fetched = False
        core = self.core
        if self.open:  # another micro-batch of an accumulated step
            self._set(first)
        else:
            self._begin(self.steps if step is None else step, first)
        if first == FORWARD:
            self._saw_forward = True
        if data_wait_ms is not None:
            core.add_host("data_wait", data_wait_ms)
        if sync_wait_ms:
            core.add_host("sync_wait", sync_wait_ms)

    def micro_batch_end(self) -> None:
        """A batch ended without an optimizer step (accumulation): until the next one, the device waits."""
        if self.open and not self.ended:
            self._relabel(IDLE)
            self._auto = IDLE

    def copied(self) -> None:
        """The batch is on the device (the door copied it): ``forward`` begins."""
        if self.open:
            self._saw_forward = True
            self._set(FORWARD)

    def forward(self, *, begins: bool = False) -> None:
        """The training forward starts.

        ``begins``: there is no loader, so a forward begins the step: after an ended step it
        closes that one and begins the next; after a backward with no optimizer step since
        (accumulation), the micro-batch in between is ``idle``; after a failed backward the
        batch is dropped.
        """
        if self.in_backward:
            return  # recomputation inside backward (activation checkpointing) is backward's
        if self.paused:
            self._wake()
        if begins and self.ended:
            self._close()
        elif begins and self.open and self._failed:
            self._drop()
        elif begins and self.open and self._after_backward:
            self.micro_batch_end()
        elif self.trailing:  # the batch goes on (a GAN's second model, SAM's second pass)
            self._continue(FORWARD)
        if not self.open:
            if not begins:
                return
            self._begin(self.steps, FORWARD)
        self._saw_forward = True
        self._after_backward = False
        self._set(FORWARD)

    def backward_start(self) -> None:
        """The loop called ``backward()`` (or Lightning's ``on_before_backward``)."""
        if not self.open or self.in_backward:
            return
        if self.paused:
            self._wake()
        if self.trailing:
            self._continue(FORWARD)
        elif self._after_backward:  # a second backward: what ran since the first was loss math
            self._relabel(FORWARD)
        if not self._saw_forward:
            self._warn_once(
                "no-forward",
                "phase-timer: a backward began in a step in which the attached module's forward never ran "
                "(its hooks did not fire: `checkpoint_sequential`, or a module that is not the one the loop "
                "calls), so the time before backward is counted as `h2d`. Attach the module the loop calls, "
                "or pass copy_to_device=True so that `forward` begins when the batch is on the device.",
            )
        self._after_backward = False
        self._saw_backward = True
        self.in_backward = True
        self._set(BACKWARD)

    def backward_end(self, *, failed: bool = False) -> None:
        """``backward()`` returned (or raised): what follows is the optimizer's until shown otherwise."""
        if not self.in_backward:
            return
        self.in_backward = False
        self._failed = failed
        self._after_backward = True
        self._set(OPTIMIZER)

    def before_backward(self) -> bool:
        """No backward yet in this step: an ``opt.step(closure)`` now runs the step's forward and backward."""
        return not self._saw_backward

    def optimizer_start(self) -> None:
        """An optimizer step begins (its step pre-hook)."""
        if not self.open:
            return
        if self.paused:
            self._wake()
        if self.trailing:  # a second optimizer right after the first: the time between is the optimizers'
            self._continue(OPTIMIZER)
        if self._saw_forward and not self._saw_backward:
            self._warn_once(
                "no-backward",
                "phase-timer: an optimizer step began with no `backward()` call seen in its step "
                "(`torch.autograd.grad`, or a backward that does not go through `torch.autograd.backward`): "
                "the gradients' computation is counted in `forward`, and `backward` is absent from such steps.",
            )
        self._after_backward = False
        self._set(OPTIMIZER)

    def step_end(self) -> None:
        """The step's device part ends here (an optimizer step ended), unless the batch goes on."""
        if not self.open:
            return
        if self.paused:
            self._wake()
        if self._mem_on:
            if self.trailing:  # the step goes on past a provisional end (a GradScaler's update): the optimizer's
                self._mem_call(self._mem.relabel, OPTIMIZER)
            self._mem_read(BETWEEN)
        # A user phase still open runs on, between steps, under its own name.
        self.core.end(self._explicit[-1]) if self._explicit else self.core.end()
        self.ended = self.trailing = True
        self._after_backward = False
        self._auto = BETWEEN

    def _count_step(self, plan: Any, batch: Any) -> None:
        """A shape not yet counted: counted on this step, which goes untimed (``step_flops.py``)."""
        counter = plan.counter  # (given FLOPs never get here: every step carries them)
        if plan.may_count is not None and not plan.may_count():
            return
        self._mod_drop()  # a step that counts FLOPs is no training step's to time modules on
        if type(self) is _SampledBoundaries:  # a sampled step's host time is the verdict's: this one is not sampled
            self._sample_state = "dropped"
            self._end_sample()
        census = self._census
        # Never the sync census's step: its syncs are the run's.
        if type(self) is not Boundaries or census is not None and census.running:
            return
        sig = signature(batch)
        if counter.wants(sig) and counter.start(sig, self._auto):
            self.core.untime()
            # An ordinary step's own-cost sample is bound to the plain class's methods (`finish`, `pause`): they
            # would miss the count's; and a counted step is no ordinary step.
            sample = self.__dict__.get(SAMPLE_KEY)
            if sample is not None:
                sample.remove()
            self.__class__ = _CountedBoundaries

    # -- pauses and ends ---------------------------------------------------------------
    def pause(self) -> None:
        """Evaluation or validation begins: neither the record nor ``period`` counts what follows."""
        if self.paused:
            return
        self._mod_drop()  # evaluation's forwards are no training step's
        self._mem_mark(PAUSED)  # a peak set in evaluation is the pause's
        self.paused = True
        self.core.pause()
        if self.open:
            self.core.phase(PAUSED)

    def resume(self) -> None:
        """The pause is over: the record goes on with the phase that ran before it."""
        if self.paused:
            self._wake()

    def epoch_end(self) -> None:
        """The loader ran out (or the loop left it): an ended step closes, a cut-off one is dropped."""
        if self.ended:
            self._close()
        elif self.open:
            self._drop()  # a step abandoned half-way, or micro-batches never stepped
        self.pause()

    def now(self) -> str:
        """The phase the boundaries say runs now (on warm-up steps too, which the core does not record)."""
        if self.paused:
            return PAUSED
        if not self.open or self._fetched:  # a micro-batch's fetch too (the core has it paused, as data_wait)
            return "data_wait"
        if not self._explicit:
            return self._auto
        # after the step's end a user phase's time is `between_steps.<name>`, as the engines name it
        return after_end(self._explicit[-1]) if self.trailing else self._explicit[-1]

    def drop(self) -> None:
        """Drop the open record, if any: what it measured cannot be trusted (a door found out too late)."""
        if self.open:
            self._drop()

    def finish(self, *, interrupted: bool = False) -> None:
        """End of training: the last step closes if it ended; a half-done one is dropped by the core.

        When nothing was timed, the core's summary says why; a run whose steps never ended
        (or that saw no batch) also warns once -- unless it was ``interrupted``: an exception
        ended it, and advice about a cause that was not the cause would only hide the real one.
        """
        self._census_unless_running()  # no step follows this close: a census not yet begun has none to hear
        if self.ended:
            self._close()
        self._mod_drop()  # a sample cut off mid-way
        self._end_census()
        self._mem_mark("after the last step")  # the run's peak, whenever it was set
        warmup = self.core.warmup_steps
        if self.begun == 0:
            self.core.untimed_reason = "no batch came through the timer"
        elif self.steps == 0 and interrupted:
            self.core.untimed_reason = "the run was interrupted before its first step ended"
        elif self.steps == 0:
            self.core.untimed_reason = f"{self.begun} step(s) began but none ended: {self.no_end_hint}"
            self._warn_once("no-end", f"phase-timer: no step was timed: {self.core.untimed_reason}")
        elif self.steps <= warmup:
            self.core.untimed_reason = (
                f"the run ended {self.steps} step(s), all within the warm-up (warmup_steps={warmup}); "
                "pass a smaller warmup_steps (0 times every step) to time a run this short"
            )

    # -- user phases ---------------------------------------------------------------------
    def enter(self, name: str) -> None:
        """A user phase opens: it owns the time until it closes (built-in boundaries wait)."""
        if self._mem_on:
            self._mem_read(name)
        self._explicit.append(name)
        if self.open and not self.paused:
            self.core.phase(name)

    def exit(self) -> None:
        """The innermost user phase closes: back to the enclosing one, or to the built-in phase."""
        self._explicit.pop()
        if self._mem_on:
            self._mem_read(self._explicit[-1] if self._explicit else self._auto)
        if self.open and not self.paused:
            self.core.phase(self._explicit[-1] if self._explicit else self._auto)

    # -- internals -----------------------------------------------------------------------
    def _set(self, phase: str) -> None:
        if self._mem_on and phase != self._auto:  # a boundary that begins the phase already running reads nothing
            self._mem_read(phase)
        self._auto = phase
        if not self._explicit:
            self.core.phase(phase)

    def _relabel(self, phase: str) -> None:
        if self._mem_on:
            self._mem_call(self._mem.relabel, phase)
        if not self._explicit:
            self.core.relabel(phase)

    def _continue(self, phase: str) -> None:
        """After a provisional end, the batch went on: the time since the end was ``phase``'s."""
        self.trailing = False
        self._relabel(phase)

    def _wake(self) -> None:
        self.paused = False
        self._mem_mark(self.now())
        self.core.resume()
        if self.open:  # the paused span ends here, whichever boundary wakes the record
            self.core.phase(self._explicit[-1] if self._explicit else self._auto)

    def _begin(self, step: int, phase: str) -> None:
        self.begun += 1
        # A memory step, unless the verdict samples this one (its reads would be in the host time it samples).
        self._step = step
        if self._mem is not None and self.begun >= self._mem_due and type(self) is Boundaries:
            self._mem_on = self._mem_call(self._mem.begin, self.begun, step, phase)
        self.core.begin_step(step, self._explicit[-1] if self._explicit else phase)
        if self.begun >= self._mod_due:  # a modules' sample (ModuleSteps), if recorded; else its pilot or after-step
            if type(self) is Boundaries:
                self._mod_begin(step)
            elif not self._mod_between() and self._mods is not None:
                self._mods.pilot(self.begun)  # the sample waits for the next step: this one is its pilot
        self.open, self.ended, self.trailing, self._auto = True, False, False, phase
        self._after_backward = self._saw_forward = self._saw_backward = self._failed = False

    def _drop(self) -> None:
        self.core.discard()
        self.open = self.ended = self.trailing = self._failed = False
        self._mod_drop()
        if self._mem_on:
            self._mem_end(self._mem.drop)

    def _close(self) -> None:
        self.steps += 1
        flight = self.steps == self._flight_at
        if flight:
            self._flight_at += flight_gap(self.steps - self.core.warmup_steps)
        if self._mod_on:  # a step it untimed itself is still a training step's
            self._mod_end(self.core.recording or self._mods.untimed)  # type: ignore[union-attr]
        self.core.close(flight)
        self.open = self.ended = self.trailing = False
        if self._mem_on:
            self._mem_end(self._mem_closed)
        self._auto = H2D
        if self.steps == self._census_at:
            self._census_step()
        self._sample_in -= 1
        if self._sample_in <= 0:
            mods = self._mods
            if mods is not None and self.begun + 1 >= mods.next_due:
                # the next step is a modules' sample, the same step on every rank: the verdict's (this rank's own,
                # at random) waits one step, rather than moving the sample (its gate) off its peers' sample
                self._sample_in = 1
            else:
                self._start_sample()

    def _start_sample(self) -> None:
        """The next step is sampled: from here to its close."""
        self._samples += 1
        self._sample_in = sample_gap(self._rng, self._samples)
        _SampledBoundaries.start(self)

    def _warn_once(self, key: str, msg: str) -> None:
        warn_once(log, self._warned, key, msg, 4)


#: The classes a step's boundaries take for one step, and give back (``run/sampled.py``).
_SampledBoundaries = sampled_class(Boundaries)
_CountedBoundaries = counted_class(Boundaries)
