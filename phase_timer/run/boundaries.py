"""What each boundary of a training step means: the one definition of every phase, for both doors.

The doors (``lightning.py``, ``loop.py``) only report what happened -- a batch was
fetched, the forward started, ``backward()`` was called, an optimizer stepped --
and :class:`Boundaries` turns that into marks on the core.  So a phase means the
same whichever door measured it:

=================  =================================================================
phase              from -> to
=================  =================================================================
``data_wait``      host: time inside the loop's fetch of the batch
``h2d``            the batch handed over -> the copy done / the model's forward
``forward``        -> the loop's ``backward()`` call (the loss is forward's)
``backward``       the ``backward()`` call -> its return (DDP/FSDP's end-of-backward
                   work included)
``optimizer``      -> the end of the batch's last optimizer step (clipping, unscaling,
                   ``optimizer.step()``, a GradScaler's ``update()``)
``idle``           accumulation: a micro-batch's end -> the next micro-batch
``step``           the sum of the above device phases
``between_steps``  the step's end -> the next fetch: schedulers, EMA, callbacks,
                   logging, checkpoints (their device work, or the device waiting
                   for their host work)
=================  =================================================================

A step ends *provisionally* at each optimizer step's end: if the same batch goes
on (a second optimizer, SAM's second pass, a GAN's generator) the step continues,
and the code in between is ``forward`` (or ``optimizer`` when the next boundary is
another optimizer step).  The record closes when the next batch is fetched.
Evaluation and validation pause the record: paused spans are nobody's time.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from phase_timer._env import native_wanted, warn_once
from phase_timer.run.core import TimingCore
from phase_timer.timing.engine import POLL_EVERY
from phase_timer.measures.flops import signature
from phase_timer.measures.memory import tracker_of
from phase_timer.measures.step_flops import FlopPlan
from phase_timer.measures.throughput import BatchCounter, RunThroughput
from phase_timer.phases import BACKWARD, BETWEEN, FETCH, FORWARD, H2D, IDLE, OPTIMIZER, PAUSED, after_end
from phase_timer.run.own_cost import SAMPLE_KEY, PlainSample
from phase_timer.measures.syncs import SyncCensus
from phase_timer.outputs.tags import memory_scalars

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
#: Steps in flight are counted at a close (one query at most, never a wait): at every second close of
#: the first FLIGHT_DENSE_STEPS timed steps (from the second: the first has no timed step before it),
#: then at every FLIGHT_EVERY-th.
FLIGHT_DENSE_STEPS = 32
FLIGHT_EVERY = 16


def flight_gap(timed: int) -> int:
    """Closes from timed step ``timed``'s (counted) close to the next counted one."""
    return 2 if timed < FLIGHT_DENSE_STEPS else FLIGHT_EVERY


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


class Boundaries:
    """One run's step state: the boundaries the doors report, turned into the core's marks."""

    # Slots: every boundary reads and writes several of these, a few µs a step in a real loop (and the
    # sampled class, swapped in and out, has the same layout).  ``__dict__``: a benchmark times a method by
    # putting a wrapper on the instance.
    __slots__ = (
        "core", "no_end_hint", "begun", "open", "ended", "trailing", "paused", "in_backward", "steps", "_auto",
        "_explicit", "_after_backward", "_saw_forward", "_saw_backward", "_failed", "_fetched", "_warned",
        "_flight_at", "_rng", "_samples", "_sample_in", "_mem", "_mem_on", "_mem_due", "_step", "_census",
        "_census_at",
        # a sampled step's (_SampledBoundaries)
        "_depth", "_own_ns", "_calls", "_t_begin", "_t_end", "_host_ns", "_sample_state", "_restart",
        "_window0",
        # what the doors call inside a step (see `_hot`)
        "on_fetch", "on_batch", "on_forward", "on_copied", "on_backward_start", "on_backward_end",
        "on_optimizer_start", "on_step_end",
        # what counts a batch (see `count_batch`)
        "counter", "flops",
        "__dict__",
    )

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
        # Memory (CUDA only): a memory step reads the allocator's counters at each boundary, through the Memory
        # measure's tracker (phase_timer/measures/memory.py).
        self._mem = tracker_of(core.measures)
        self._mem_on = False  # this step is a memory step
        self._mem_due = self._mem.next_due if self._mem is not None else 0
        self._step = 0  # the step index the door gave the last step begun
        # The sync census (device clock): on the last warm-up step, from the close before it to its own.
        self._census: SyncCensus | None = None
        self._census_at = -1  # the close (1-based) at which the census starts, then stops
        if core.clock.kind == "host":
            core.signals.census = "not run: no device (host clock)"
        elif warmup < 2:
            core.signals.census = f"not run: it needs a warm-up step after the first (warmup_steps={warmup} < 2)"
        else:
            self._census, self._census_at = SyncCensus(self.now), warmup - 1
        #: What counts each batch (``count_batch``): throughput's counter and the FLOP plan, the core's measures
        #: (``measures/throughput.py``, ``measures/step_flops.py``; None: not counted).
        self.counter: BatchCounter | None = next((m.counter for m in core.measures if isinstance(m, RunThroughput)), None)
        self.flops: FlopPlan | None = next((m for m in core.measures if isinstance(m, FlopPlan)), None)
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

    # -- what a batch holds -------------------------------------------------------------
    def count_batch(self, batch: Any, step_batch: Any = None, samples: bool = True) -> None:
        """A batch was handed over (after :meth:`batch`): its samples and tokens, and at a step's first batch
        its FLOPs (``step_flops.py``).  ``step_batch``: what the step's FLOPs depend on when the door has every
        micro-batch at once (the 🤗 Trainer's), else ``batch``; ``samples=False``: its FLOPs only.  Shapes only,
        never a value: no sync.
        Every step pays this: one frame, the signature, a dict lookup and three host values (a few µs)."""
        core = self.core
        counter = self.counter
        if counter is not None and samples:
            counter.add(core.add_host, batch)
        plan = self.flops
        if plan is None or plan.begun == self.begun or not self.open:
            return
        plan.begun = self.begun
        if step_batch is None:
            step_batch = batch
        try:
            carried = plan.given_carried or plan.carried.get(signature(step_batch))
        except TypeError as err:  # a batch item whose .shape is no shape (unhashable): no FLOPs, training goes on
            self.flops, plan.dropped = None, True
            self._warn_once("flops", f"phase-timer: the batch's shapes cannot be read ({err}); no FLOPs nor MFU")
            return
        if carried is None:
            self._count_step(plan, step_batch)
            return
        add = core.add_host
        for name, value in carried:
            add(name, value)

    def _count_step(self, plan: Any, batch: Any) -> None:
        """A shape not yet counted: counted on this step, which goes untimed (``step_flops.py``)."""
        counter = plan.counter  # (given FLOPs never get here: every step carries them)
        if plan.may_count is not None and not plan.may_count():
            return
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
        if self._census is not None and not self._census.running:
            self._census_at = -1  # no step follows this close: the census has none to hear
        if self.ended:
            self._close()
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
        self.open, self.ended, self.trailing, self._auto = True, False, False, phase
        self._after_backward = self._saw_forward = self._saw_backward = self._failed = False

    def _drop(self) -> None:
        self.core.discard()
        self.open = self.ended = self.trailing = self._failed = False
        if self._mem_on:
            self._mem_end(self._mem.drop)

    def _close(self) -> None:
        self.steps += 1
        flight = self.steps == self._flight_at
        if flight:
            self._flight_at += flight_gap(self.steps - self.core.warmup_steps)
        self.core.close(flight)
        self.open = self.ended = self.trailing = False
        if self._mem_on:
            self._mem_end(self._mem_closed)
        self._auto = H2D
        if self.steps == self._census_at:
            self._census_step()
        self._sample_in -= 1
        if self._sample_in <= 0:
            self._start_sample()

    def _mem_read(self, phase: str) -> None:
        mem = self._mem
        if mem.full:  # a step that never ends (no optimizer step heard): its reads stop here
            self._mem_end(mem.drop)
        elif not self._mem_call(mem.read, phase):
            self._mem_on = False

    def _mem_end(self, fn: Any, *args: Any) -> None:
        """The memory step is over (closed, dropped, or read full): ``fn`` folds it in; the next one is due."""
        self._mem_on = False
        if self._mem_call(fn, *args):
            self._mem_due = self._mem.next_due  # type: ignore[union-attr]

    def _mem_closed(self) -> None:
        """The memory step closed: its values (MB) go to the sinks at its step (``phase_memory/<what>_mb``)."""
        tracker = self._mem
        scalars = memory_scalars(tracker.end_step())
        self.core.add_row(tracker.step, scalars)

    def _mem_mark(self, phase: str) -> None:
        """A read at a pause's begin or end or at the run's end; inside a memory step, one of its reads."""
        if self._mem_on:
            self._mem_read(phase)
        elif self._mem is not None:
            self._mem_call(self._mem.mark, phase, self.begun, self._step)

    def _mem_call(self, fn: Any, *args: Any) -> bool:
        """A call on the memory tracker, its host time counted; a failure warns once and memory stops, the
        training goes on."""
        t0 = time.perf_counter_ns()
        try:
            fn(*args)
            self._mem.own_ns += time.perf_counter_ns() - t0  # type: ignore[union-attr]
            return True
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            if self._mem is not None:  # what was read stays, with why it stopped
                self._mem.failed = f"{type(err).__name__}: {err}"
            self._mem, self._mem_on = None, False
            self._warn_once("memory", f"phase-timer: memory is no longer read ({type(err).__name__}: {err}); "
                                      "the time phases go on")
            return False

    def _census_step(self) -> None:
        """The census starts here (the last warm-up step begins), or stops (that step has closed)."""
        census = self._census
        if census is not None and not census.running:
            if census.start():
                self._census_at += 1
                return
        self._end_census()

    def _end_census(self) -> None:
        census, self._census, self._census_at = self._census, None, -1
        if census is not None:
            census.stop()
            self.core.signals.add_census(census, self.core.warmup_steps)

    def _start_sample(self) -> None:
        """The next step is sampled: from here to its close."""
        self._samples += 1
        self._sample_in = sample_gap(self._rng, self._samples)
        _SampledBoundaries.start(self)

    def _warn_once(self, key: str, msg: str) -> None:
        warn_once(log, self._warned, key, msg, 4)


class _CountedBoundaries(Boundaries):
    """The step whose FLOPs are being counted (untimed): each boundary also marks the FLOP count's phase.

    Swapped in for that one step as a sampled step's class is (the same slots): the C boundaries take
    the methods' path while it is on.  The count ends at the step's close (a batch that goes on after
    its first optimizer step is counted whole), or is dropped with the step."""

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
        self.__class__ = Boundaries
        plan = self.flops
        flops = plan.counter.stop(drop=(PAUSED,)) if keep else plan.counter.close()
        if flops is not None:
            plan.carried[plan.counter.last_signature] = plan.carry(flops)

    def _close(self) -> None:
        self._end_count(keep=True)
        Boundaries._close(self)  # plain from here: a sampled step may begin at this close

    def _drop(self) -> None:
        self._end_count(keep=False)
        Boundaries._drop(self)

    def finish(self, *, interrupted: bool = False) -> None:
        self._end_count(keep=self.ended)  # a step cut off mid-way: no count
        Boundaries.finish(self, interrupted=interrupted)


def _pair_ns() -> int:
    """What one timed call adds to its own reading: the cheapest of a few back-to-back clock reads."""
    clock = time.perf_counter_ns
    best = 1 << 62
    for _ in range(50):
        t = clock()
        best = min(best, clock() - t)
    return best


class _SampledBoundaries(Boundaries):
    """A sampled step's boundaries: the same calls, each timed (the instance's class is swapped in and out).

    From the close of the step before to the sampled step's own close, every call a door makes
    is timed from entry to return, outermost only: the host time phase-timer spends on the
    training thread (boundaries, marks, poll and resolve, window statistics, writes queued,
    the rank exchange).  The host time from the step's begin to its (last) end is kept too:
    the device's step over it says whether the device keeps pace with the host.
    """

    __slots__ = ()
    _PAIR_NS: int | None = None

    @classmethod
    def start(cls, bounds: Boundaries) -> None:
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
        ctx = self.core.context
        # Inside the loop's autocast, if any; a door that knows the precision (Lightning) has said it.
        if self.open and "autocast" not in ctx and "precision" not in ctx:
            from phase_timer.runinfo import autocast_dtype

            ctx["autocast"] = autocast_dtype(ctx.get("device_type", "cuda"))

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
        self.__class__ = Boundaries
        if state == "closed" and self._host_ns:
            self.core.add_sample(own, self._host_ns / 1e6)
        if self._restart:
            self._start_sample()
        elif state == "closed":  # the next ordinary step is timed as it runs, for the own-cost line (own_cost.py)
            PlainSample.start(self, pair)


def _timed(name: str) -> Any:
    inner = _SampledBoundaries.__dict__.get(name) or getattr(Boundaries, name)

    def method(self: _SampledBoundaries, *args: Any, **kwargs: Any) -> Any:
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


for _name in ("fetch", "batch", "count_batch", "micro_batch_end", "copied", "forward", "backward_start", "backward_end",
              "optimizer_start", "step_end", "pause", "resume", "epoch_end", "drop", "finish", "enter", "exit"):
    setattr(_SampledBoundaries, _name, _timed(_name))
