"""Exposed communication: how much of ``backward`` waits for DDP's all-reduce, every step, with no sync.

DDP launches each gradient bucket's all-reduce as the bucket's last gradient is computed, on the autograd
thread; its *end-of-backward*, an autograd final callback it queues when the last bucket is ready, makes the
compute stream wait for every bucket's collective (the host, on a CPU) and puts the results into ``.grad``.
What the network costs the step is that end: the compute stream's wait for the collectives backward's compute
could not hide.

:class:`DdpComm` brackets it on the compute stream (``backward.comm_wait``), with no hook of its own on the
buckets: a hook on one parameter's gradient accumulation (it runs before DDP can see its last bucket ready)
queues an autograd final callback, which the engine runs after all of backward's compute and *before* DDP's
end-of-backward (queued later).  That callback is the engine's own switch to the wait (no Python frame); the
span ends where ``backward`` does, when the loop's ``backward()`` returns: nothing is enqueued between DDP's
end-of-backward and that return.  One parameter hook and one mark a synced backward, whatever the number of
buckets (a Python comm hook costs tens of µs a bucket); no stream wait of its own, so DDP's schedule is
untouched; a comm hook of the user's (registered before or after, built-in or not) runs inside the span as DDP
runs it.  The span is part of ``backward`` (``phases.part_of``): the phases still add up to ``step``.  A
``no_sync()`` micro-batch has no end-of-backward, and no span.  (With a composed hook, below, or on a module whose
device catches up with its host inside the span, further below, the wait's start is a Python callback, which
queues one more after DDP's end-of-backward to end it there.)

What the span holds besides the wait: DDP's end-of-backward copies each bucket's result into ``.grad``
after that bucket's wait unless ``gradient_as_bucket_view=True`` (a read and a write of the gradients; with a
comm hook that returns a new tensor, a copy back into the bucket).  Those copies are backward's compute, the
same bytes every step.  They run where DDP puts them: a bucket's after its own wait, while the later buckets'
collectives still run beside them (sharing the device's memory and SMs, so they run slower than alone), at the
pace the host launches them.  On sampled backwards a dispatch mode, pushed for DDP's end-of-backward only,
watches DDP's ``copy_`` calls into ``.grad``: on the 2nd synced backward it counts them a bucket (a bucket's
copies read one storage); from the next, it marks the compute stream before each bucket's first copy and after
its last (by that count), so the copies are timed where and as they run, with no mark between two copies (a
timed event there costs the stream microseconds, a copy as little) and none across a wait.  A backward whose
copies do not fall as counted (a rebuild of the buckets) is counted anew and timed on the next.  Under
``find_unused_parameters=True`` DDP reads each parameter's flag in its used-parameter map on
the host among the copies, and where one got no gradient on this rank it first waits for the map's all-reduce
(after every bucket's) and copies the map to the host: that wait falls among a bucket's copies, and which
parameters copy changes from step to step.  A sampled backward that saw that copy is not read, and the module's
copies are not timed from then on (they stay in ``backward.comm_wait``, and the table says so); a model whose
every parameter gets a gradient on every rank (the 🤗 Trainer's default runs with ``find_unused_parameters``)
has its copies timed as under DDP's defaults.  The copies' time is each bucket's
median over its last samples whose copies were all queued before the device reached them (their own time, back to
back), summed; it is taken off each step's ``backward.comm_wait`` (never below zero) when its window is made, and
stays in ``backward``.  A sample whose device caught up with the host among a bucket's copies holds the pace of
DDP's launches (and the mode's Python, which ``copies.Copies.ms`` takes off), not their own time, and adds nothing:
such a step's span loses the host's time in it whole on the paced path below where its questions say the device
kept pace, and a bucket no sample saw queued adds nothing (the table says so) until a sample sees it
queued: a host-paced span kept whole because its device still waits in it (a rank waiting for its peer),
or one whose device is still behind its host at its end (a device-bound rank's), has the next synced
backward's copies timed where a bucket has none queued (``RESAMPLE`` a binding): their copies queue.
(A static graph's first-iteration all-reduce is queued at backward's start, so it runs before the span, in
``backward``.)  Where the split is missed, silently: a backward in which the parameter heard gets no gradient
(unused that step, frozen after attach); that parameter inside a reentrant activation checkpoint
(``use_reentrant=True``), where its hook runs in a nested backward and the span would start at that backward's end
(so the parameter heard is the shallowest, see :meth:`DdpComm.install`).

Where the device catches up with the host inside the span (a host-paced backward), the wait is taken as the span
less the host's time in it: :mod:`phase_timer.measures.comm.paced` says when and how.

The collectives' own time (for the hidden share, ``1 - exposed / communication``) needs the buckets' futures,
which only a comm hook sees: where the user registers one after phase-timer saw the module (through the
module's own ``register_comm_hook``, or a built-in), it runs inside phase-timer's, which on sampled backwards
(the first 8, then one in 16; every one on the host clock) times each bucket's collective from its launch (or
the previous one's end, whichever is later: one process group runs them in order) to its future's completion,
read off the training thread.  The samples resolve a few steps later, and ride on the record then open as
carried values (``comm_ms``, ``comm_wait_ms``: the same sampled steps' span).  Without a user hook, none: the
split costs no Python call a bucket.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections import deque
from functools import partial
from typing import Any

from phase_timer._env import warn
from phase_timer.measures.comm.copies import _ACTIVE, _copy_marker, _pop_mode, _push_mode
from phase_timer.measures.comm.paced import PacedSpans, register_optimizer_step_pre_hook
from phase_timer.measures.comm.run import COMM_MS, COMM_SAMPLES, COMM_WAIT_MS, WAIT, RunComm
from phase_timer.measures.comm.run import of as run_of
from phase_timer.patches import Patches
from phase_timer.phases import BACKWARD

try:
    from phase_timer._native import Arm
except ImportError:  # not built: the parameter's hook is a Python call
    Arm = None

log = logging.getLogger(__name__)

#: Device clock: the collectives' own time on the first DENSE backwards, then one in EVERY.
DENSE, EVERY = 8, 16
#: DDP's own record of its last forward's decision: True when it prepared a synced backward (False under
#: ``no_sync()``, or after a forward with no grad).
SYNCED = "require_forward_param_sync"
#: DDP's copies into ``.grad``: on the synced backward COPY_LEARN (counted from 1) the buckets' copies are counted
#: (no mark); then timed on the next COPY_DENSE synced backwards, then one in COPY_EVERY or more: as many as keep a
#: sampled backward's own host time under COPY_BUDGET_NS a backward, spread; the estimate is each bucket's median over
#: its last samples, its queued ones first (``run.COPY_KEEP``).  A backward whose buckets do not copy as counted is
#: counted again (not timed).
COPY_LEARN, COPY_DENSE, COPY_EVERY, COPY_BUDGET_NS = 2, 3, 1024, 1000
#: A span whose copies queued (its device behind its host at its end, or still waiting in it at the optimizer step), on
#: a module with a bucket no sample saw queued: the next synced backward's copies are timed, at most RESAMPLE times a
#: binding (:meth:`DdpComm._resample`).
RESAMPLE = 3


class DdpComm(PacedSpans):
    """The exposed-communication split of one DDP module (see the module's text)."""

    def __init__(self, ddp: Any, param: Any) -> None:
        self.ddp = ddp
        self._inner: Any = None  # the user's hook, composed (None: DDP's own, in C++)
        self._state: Any = None
        self._core: Any = None
        self._run: RunComm | None = None  # the core's communication measure while bound
        self._engine: Any = None  # the core's engine while bound
        self._to_wait: Any = None  # its switch to the wait: a final callback with no Python frame
        self._start: Any = None  # what the hook queues on a usual synced backward: _to_wait, or _paced_start
        self._paced = False  # the paced path: the span's host time noted, the device asked (PacedSpans)
        self._copying = False  # DDP copies into .grad (timed on sampled backwards, which say whether it is paced)
        self._cold = 0  # synced backwards in a row since the paced path last saw the device caught up
        self._h0: int | None = None  # perf_counter_ns at the open span's start, where noted
        self.paced_steps = 0  # backwards whose host time in the span was taken off the wait, while bound
        self.paced_ms = 0.0  # and how much in all (ms)
        self.paced_waiting = 0  # host-paced spans whose device was still in them at the next optimizer step
        self._deferred: tuple[list[Any], Any, bool, int, float] | None = None  # the last span's second question
        self._opt_hooks: tuple[Any, Any] | None = None  # the global optimizer step hooks that ask it, while paced
        self._in_step = False  # between an optimizer step's pre- and post-hook (a closure's backward)
        self._asking = True  # the second question can be asked (a torch with global hooks; no failure asking it)
        self._spans: list[list[Any]] | bool | None = None  # this backward's sample: [launch, end] a bucket (False: not)
        self._open: tuple[list[list[Any]], Any] | None = None  # a sampled span begun: (spans, its start)
        self._synced = 0  # synced backwards split while bound
        self._pending: deque[tuple[list[list[Any]], Any, Any, list[Any] | None]] = deque()  # samples unresolved
        self._device = False
        self.user_hook: str | None = None  # the name of the user's hook composed, if any
        import torch
        from torch.autograd import Variable

        self._event = partial(torch.cuda.Event, enable_timing=True)
        self._queue_callback = Variable._execution_engine.queue_callback  # bound once, not looked up a backward
        self._param = param  # the one whose gradient accumulation starts the wait (see install)
        self._handle: Any = None  # its hook while bound
        self._armed: Any = None  # that hook: a native Arm (it counts down to a sampled backward) or _began
        self._due = 0  # _began's countdown to a backward whose copies are timed (0: none)
        self._copies: Any = None  # the dispatch mode pushed for this backward's end-of-backward, if sampled
        self._copy_taken = 0  # backwards whose copies were timed while bound
        self._copy_t0 = 0  # perf_counter_ns where the sampled one began
        self.copy_host_ns: list[int] = []  # each sampled end-of-backward's host time (DDP's own in), while bound
        self._counts: list[int] | None = None  # DDP's copies a bucket, in its order (counted on a sampled backward)
        self._map_read = False  # a sampled end-of-backward saw DDP read its used-parameter map: copies untimed
        self._resamples = RESAMPLE  # samples a waiting span may still ask for (_resample), while bound

    # -- installation ---------------------------------------------------------------
    @classmethod
    def install(cls, ddp: Any) -> tuple[DdpComm | None, str | None]:
        """Split ``ddp``'s end-of-backward (once: a module already split returns its own); or None and why not.

        The parameter heard is the shallowest DDP reduces (the first of them): an embedding's or a head's,
        rather than one inside a block that reentrant activation checkpointing could run in a nested backward.
        """
        own = _PROBES.get(ddp)
        if own is not None:
            return own, None
        ignored = getattr(ddp, "parameters_to_ignore", ())
        named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
        if not named or getattr(ddp, "reducer", None) is None:
            return None, "it has no parameter whose gradients it all-reduces"
        probe = cls(ddp, min(named, key=lambda np: np[0].count("."))[1])
        if getattr(ddp, "_comm_hooks", None):  # the user's, registered before: inside the span, not sampled
            probe.user_hook = getattr(ddp._comm_hooks[0][0], "__qualname__", "a comm hook")
        else:
            try:
                probe.user_hook = ddp._get_ddp_logging_data().get("comm_hook") or None
            except Exception:  # noqa: BLE001 - an older DDP: no name to read
                pass
        _PROBES[ddp] = probe
        if probe.user_hook is None:  # one registered later runs inside ours, which samples the collectives
            _wrap_ddp()
        return probe, None

    def _register_user(self, state: object, hook: Any) -> None:
        """The module's ``register_comm_hook``: the user's hook runs inside ours (DDP's checks and record kept)."""
        self._once()
        self.ddp._check_comm_hook(hook)
        self._compose(hook, state, getattr(hook, "__qualname__", repr(hook)))
        self.ddp._comm_hooks.append((hook, state))

    def _register_builtin(self, comm_hook_type: Any) -> None:
        """The module's ``_register_builtin_comm_hook``: DDP's built-ins, as their Python twins inside ours."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self._once()
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            hook, state = default_hooks.fp16_compress_hook, self.ddp.process_group
        elif comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            hook, state = default_hooks.allreduce_hook, self.ddp.process_group
        else:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}")
        self._compose(hook, state, str(comm_hook_type))

    def _once(self) -> None:
        if self.user_hook is not None:  # DDP's own rule, with its words
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")

    def _compose(self, hook: Any, state: object, name: str) -> None:
        """Register ours, running ``hook`` inside it, under ``name`` (DDP's logging and the run's record say it)."""
        _DDP_OWN["register_comm_hook"](self.ddp, None, self._hook)
        self.ddp._comm_hooks.clear()  # DDP's record of Python hooks holds the user's (appended next), not ours
        logger = getattr(self.ddp, "logger", None)
        if logger is not None:
            logger._set_comm_hook_name(name)
        self._inner, self._state, self.user_hook = hook, state, name
        if self._run is not None:
            self._run.hook = name
        self._arm()  # the wait's start is a Python callback now (it ends the sampled span, after DDP's)

    def bind(self, core: Any) -> None:
        """Time into ``core``'s records from now on (None: stop; a composed hook then only forwards)."""
        self._unhook_optimizer()  # a question of the last binding's is not this one's
        self._core = core
        self._run = run_of(core) if core is not None else None
        self._engine = core._engine if core is not None else None
        self._to_wait = partial(self._engine.switch, WAIT) if core is not None else None
        self._copying = not getattr(self.ddp, "gradient_as_bucket_view", True)
        self.paced_steps, self.paced_ms, self.paced_waiting = 0, 0.0, 0
        self._asking = register_optimizer_step_pre_hook is not None
        self._device = core is not None and core.clock.kind != "host"
        # the paced path's questions from the first synced backward (a device, both questions askable, no
        # used-parameter map read inside the span), until PACED_OFF answers "behind" in a row
        on = self._device and self._asking and not self._find_unused()
        self._start, self._paced, self._cold, self._h0 = self._paced_start if on else self._to_wait, on, 0, None
        run = self._run
        if run is not None:
            run.hook = self.user_hook
            run.copy = run.copy or not getattr(self.ddp, "gradient_as_bucket_view", True)
            run.untimed_copies = run.untimed_copies or self._untimeable()
        # a deferral still live (bound anew between _split and _joined) is left to _joined, which pops and replays it
        self._spans, self._open, self._synced, self._copy_taken = None, None, 0, 0
        self._resamples = RESAMPLE
        self.copy_host_ns = []
        self._pending.clear()
        self._arm()
        self._schedule(0 if self._untimeable() else COPY_LEARN)

    def _untimeable(self) -> bool:
        """A sampled end-of-backward saw DDP copy its used-parameter map to the host (a parameter without a
        gradient on this rank, under ``find_unused_parameters=True``): DDP waited for the map's
        all-reduce in the middle of a bucket's copies, and the set of copies changes with the parameters used; the
        copies are not timed from then on (they stay in ``backward.comm_wait``, and the table says so)."""
        return self._map_read

    def _find_unused(self) -> bool:
        """``find_unused_parameters=True``: DDP may read its used-parameter map on the host inside the span."""
        return bool(getattr(self.ddp, "find_unused_parameters", False))

    def _arm(self) -> None:
        """The parameter's hook, for the binding and the path now (none unbound)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._engine is None:
            return
        due = self._armed.due if Arm is not None and isinstance(self._armed, Arm) else self._due
        hook: Any = self._began
        if self._inner is None and Arm is not None:  # the usual path: one C call, no Python frame
            hook = Arm(self._engine, BACKWARD, self.ddp, SYNCED, self._queue_callback, self._start,
                       self._sample_copies)
        self._armed = hook
        self._schedule(due)
        self._handle = self._param.register_post_accumulate_grad_hook(hook)

    def _schedule(self, due: int) -> None:
        """Time DDP's copies on the ``due``-th synced backward from now (0: none)."""
        if Arm is not None and isinstance(self._armed, Arm):
            self._armed.due = due
        else:
            self._due = due

    def _resample(self) -> None:
        """A span whose copies queued: its device was still behind its host at the span's end, or still waited in
        it at the optimizer step (a rank waiting for its peer).  A bucket whose copies no sample saw queued adds
        nothing to the copies' estimate (its samples all caught up with the host: taken while this rank was
        host-paced), so such a step's span keeps that bucket's copies in its wait; a device behind or waiting queues
        them: the next synced backward's are timed, their own time comes in (at most RESAMPLE such samples a
        binding, none while a sample of this module is still to resolve; one is ~the end-of-backward's host time
        with the mode's Python, ms on hundreds of parameters)."""
        if self._resamples <= 0 or not self._copying or self._map_read:
            return
        run = self._run
        due = self._armed.due if Arm is not None and isinstance(self._armed, Arm) else self._due
        if due != 1 and run is not None and run.unqueued(self):
            self._resamples -= 1
            self._schedule(1)

    def remove(self, core: Any = None) -> None:
        """Unbind and take the parameter's hook off, unless another timer (not ``core``) bound it since; the
        module is then as found (a composed comm hook stays in DDP, where nothing can remove it: it forwards)."""
        if core is not None and self._core is not core:
            return
        self.bind(None)
        if _PROBES.get(self.ddp) is self:
            del _PROBES[self.ddp]
        if not _PROBES:
            _unwrap_ddp()

    # -- the user's comm hook, composed (autograd thread) -------------------------------------
    def _hook(self, _state, bucket):  # noqa: ANN001, ANN202 - no annotations: DDP checks them against its own types
        engine = self._engine
        if engine is None:
            return self._inner(self._state, bucket)
        if bucket.index() == 0:  # this backward's first bucket: a sampled one? (a timed step's only)
            self._spans = [] if engine.current == BACKWARD and self._sampled() else False
        spans = self._spans
        if spans is None or spans is False:
            return self._inner(self._state, bucket)
        span = [self._now(), None]
        fut = self._inner(self._state, bucket)
        spans.append(span)
        fut.add_done_callback(partial(self._ended, span))
        return fut

    def _sampled(self) -> bool:
        n = self._synced
        return not self._device or n < DENSE or n % EVERY == 0

    def _now(self) -> Any:
        if not self._device:
            return time.perf_counter_ns()
        ev = self._event()
        ev.record()  # the current stream: the compute stream at the hook, a stream synced to the future at its end
        return ev

    def _ms(self, a: Any, b: Any) -> float:
        """Milliseconds from ``a`` to ``b``, two of :meth:`_now`'s (events: both done)."""
        return a.elapsed_time(b) if self._device else (b - a) / 1e6

    def _ended(self, span: list[Any], _fut: Any) -> None:
        span[1] = self._now()

    # -- the span (autograd's final callbacks) ---------------------------------------------
    def _began(self, _param: Any) -> None:
        """The parameter's gradient is accumulated: DDP's last bucket is not ready yet (its hook runs after).

        A synced backward (DDP decided at its forward: ``require_forward_param_sync``; under ``no_sync()`` it has
        no end-of-backward), timed in ``backward`` (a record open, not paused, no user phase open): the wait's
        start is queued.  Without a composed hook, that start is the
        engine's own ``switch`` (no Python frame) and the span ends with ``backward`` itself (nothing is
        enqueued after DDP's end-of-backward before backward returns); with one, :meth:`_split`.
        """
        engine = self._engine
        if engine is None or engine.current != BACKWARD or not getattr(self.ddp, SYNCED, False):
            return
        self._synced += 1  # the sampling schedule counts these
        due = self._due
        if due > 0:
            self._due = due - 1
        if due == 1:
            self._queue_callback(self._sample_copies)
        else:
            self._queue_callback(self._start if self._inner is None else self._split)

    def _split(self, copies: bool = False) -> None:
        """After backward's compute, before DDP's end-of-backward (a composed hook's backward, or one whose copies
        are timed): the wait begins."""
        spans, self._spans = self._spans, None
        left, self._copies = self._copies, None  # one a DDP error left (autograd's guard popped its mode)
        if left is not None:
            if _ACTIVE[0] is left:
                _ACTIVE[0] = None  # _joined must not pop it again, and the next sample may begin
            if left.marks:
                left.clock.release(left.marks)
        engine = self._engine
        if engine is None:
            return
        self._drop_deferred()
        engine.switch(WAIT)
        self._h0 = time.perf_counter_ns()
        if spans:
            self._open = (spans, self._now())
        if copies and _ACTIVE[0] is not None:  # another module's copies are marked in this backward: next time
            self._schedule(1)
        elif copies and self._untimeable():
            self._schedule(0)  # never: see _untimeable
        elif copies:
            self._schedule(COPY_EVERY)  # the next one, unless _joined (after DDP's end-of-backward) says sooner or later
            self._copy_t0 = time.perf_counter_ns()
            clock = self._core.clock if self._core is not None and self._counts else None
            self._copies = _ACTIVE[0] = _copy_marker(self.ddp.module.parameters(), self._counts, clock)
            _push_mode(self._copies)  # the C stack only: autograd's own thread-state guard pops it if DDP raises
        self._queue_callback(self._joined)  # after DDP's end-of-backward, queued before this one ran

    def _sample_copies(self) -> None:
        """The wait begins on a backward whose end-of-backward copies are timed (queued by the hook on schedule)."""
        self._split(copies=True)

    def _joined(self) -> None:
        """After DDP's end-of-backward: the wait is over (and, on a sampled backward, its copies were counted or
        timed)."""
        copies, self._copies = self._copies, None
        kept_up = None
        if copies is not None:
            _pop_mode(copies)
            if _ACTIVE[0] is copies:
                _ACTIVE[0] = None
            kept_up = self._took(copies)
        engine = self._engine
        opened, self._open = self._open, None
        if engine is None or engine.current != WAIT:
            return
        w1 = self._now() if opened is not None else None  # a composed hook's sample ends here too (copies in)
        h1 = time.perf_counter_ns()
        engine.switch(BACKWARD)
        held = self._settle(engine, h1, kept_up)
        if opened is not None:
            self._pending.append((*opened, w1, held))
        if self._pending:
            self._resolve(engine)

    def _took(self, copies: Any) -> bool | None:
        """A sampled end-of-backward's copies: timed (their marks to the run's estimate) if they were made as
        counted, else counted anew and timed on the next synced backward.  Timed: whether the device had caught up
        with the host at the last bucket's copies (``Copies.caught``); else None."""
        pairs = copies.pairs()  # None where DDP read its used-parameter map among them (copies.synced)
        run = self._run
        if pairs is None or run is None:
            if copies.marks and copies.clock is not None:
                copies.clock.release(copies.marks)
            if copies.synced:  # DDP waited for its used-parameter map among the copies: untimed from now on
                self._map_read = True
                self._schedule(0)
                if run is not None:
                    run.untimed_copies = True
                    run.forget_copies(self)
                return None
            self._counts = copies.counts or None
            self._schedule(1 if self._counts else COPY_EVERY)  # nothing copied: DDP copies nothing here
            return None
        self._copy_taken += 1
        spent = time.perf_counter_ns() - self._copy_t0  # the sampled end-of-backward's host time, DDP's own in
        self.copy_host_ns.append(spent)
        del self.copy_host_ns[:-16]
        self._schedule(1 if self._copy_taken < COPY_DENSE else max(COPY_EVERY, -(-spent // COPY_BUDGET_NS)))
        run.add_copies(self, pairs, copies.clock)
        return pairs[-1].caught

    def _resolve(self, engine: Any) -> None:
        """Sampled backwards whose events are all done and whose host-paced question is answered (never waits),
        carried on the open record."""
        while self._pending:
            spans, w0, w1, held = self._pending[0]
            if any(end is None for _, end in spans) or held is not None and held[2] is None:
                return
            paced = held[2] if held is not None else 0.0
            if self._device and not (w1.query() and all(end.query() for _, end in spans)):
                return
            self._pending.popleft()
            comm, prev = 0.0, -float("inf")  # ms from w0; one process group runs its collectives in order
            for launch, end in spans:
                a, b = self._ms(w0, launch), self._ms(w0, end)
                comm += max(0.0, b - max(a, prev))
                prev = max(prev, b)
            engine.add_host(COMM_MS, comm)  # a record may carry two samples: they sum, and so does their count
            engine.add_host(COMM_WAIT_MS, max(0.0, self._ms(w0, w1) - paced))  # as the step's wait (_settle)
            engine.add_host(COMM_SAMPLES, 1.0)


#: Each DDP module's split (weak: a module dropped takes its entry along); none is an attribute of the module,
#: which stays picklable and deep-copyable (an EMA copy of it).
_PROBES: weakref.WeakKeyDictionary[Any, DdpComm] = weakref.WeakKeyDictionary()
#: DDP's two registrations, wrapped while a split module lives; DDP's own, which ``_compose`` calls past ours.
_DDP_PATCHES = Patches()
_DDP_OWN: dict[str, Any] = {}


def _composing(original: Any, compose: Any) -> Any:
    """DDP's ``original`` registration: on a split module with no comm hook yet, ``compose(probe, ...)`` runs the
    user's hook inside phase-timer's; anywhere else, DDP's own."""

    def registration(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        probe = _PROBES.get(self)
        if probe is None or probe.user_hook is not None and probe._inner is None:  # not ours to compose
            return original(self, *args, **kwargs)
        return compose(probe, *args, **kwargs)

    return functools.update_wrapper(registration, original)


def _wrap_ddp() -> None:
    """DDP's two registrations, wrapped once in the process while a split module lives."""
    if _DDP_PATCHES:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name, compose in (("register_comm_hook", DdpComm._register_user),
                          ("_register_builtin_comm_hook", DdpComm._register_builtin)):
        original = _DDP_OWN[name] = getattr(DDP, name)
        _DDP_PATCHES.replace(DDP, name, _composing(original, compose))


def _unwrap_ddp() -> None:
    _DDP_PATCHES.put_back()


def attach_ddp(model: Any, core: Any) -> DdpComm | None:
    """Split ``model``'s exposed communication into ``core`` if it is a DistributedDataParallel (else None)."""
    ddp = find_ddp(model)
    if ddp is None:
        return None
    probe, why = DdpComm.install(ddp)
    if probe is None:
        warn(log, f"phase-timer: backward's wait for DDP's all-reduce is not split out (backward.comm_wait): {why}.", 3)
        return None
    probe.bind(core)
    return probe



def find_ddp(model: Any) -> Any:
    """The DistributedDataParallel ``model`` is, or wraps (torch.compile's module), or None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    for m in (model, getattr(model, "_orig_mod", None)):
        if isinstance(m, DistributedDataParallel):
            return m
    return None
