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
``no_sync()`` micro-batch has no end-of-backward, and no span.  (With a composed hook, below, the wait's start
is a Python callback, which queues one more after DDP's end-of-backward to end it there.)

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
``find_unused_parameters=True`` the copies are not timed: DDP waits for its used-parameter map's all-reduce among
a bucket's copies, and which parameters copy changes from step to step.  The copies' time (each bucket's, summed; the median of the last samples) is taken off each
step's ``backward.comm_wait`` (never below zero) when its window is made, and stays in ``backward``.  (On a
sampled backward the mode's own host time, a few µs a copy, paces the copies where the device has caught up with
the host; the estimate then holds that pace too.)  (A static graph's first-iteration all-reduce is queued at
backward's start, so it runs before the span, in ``backward``.)  Where the split is missed, silently: a
backward in which the parameter heard gets no gradient (unused that step, frozen after attach); that
parameter inside a reentrant activation checkpoint (``use_reentrant=True``), where its hook runs in a nested
backward and the span would start at that backward's end (so the parameter heard is the shallowest, see
:meth:`DdpComm.install`).

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
import statistics
import time
import weakref
from collections import deque
from functools import partial
from typing import Any

from phase_timer._env import warn
from phase_timer.patches import Patches
from phase_timer.phases import BACKWARD, comm_label

try:
    from phase_timer._native import Arm
except ImportError:  # not built: the parameter's hook is a Python call
    Arm = None

log = logging.getLogger(__name__)

WAIT = comm_label(BACKWARD)
#: Carried on a record (sampled): the collectives' own time of a sampled synced backward, and its exposed wait.
COMM_MS, COMM_WAIT_MS, COMM_SAMPLES = "comm_ms", "comm_wait_ms", "comm_samples"
CARRIED = (COMM_MS, COMM_WAIT_MS, COMM_SAMPLES)
#: Device clock: the collectives' own time on the first DENSE backwards, then one in EVERY.
DENSE, EVERY = 8, 16
PREFIX = "comm"
#: DDP's own record of its last forward's decision: True when it prepared a synced backward (False under
#: ``no_sync()``, or after a forward with no grad).
SYNCED = "require_forward_param_sync"
#: DDP's copies into ``.grad``: on the synced backward COPY_LEARN (counted from 1) the buckets' copies are counted
#: (no mark); then timed on the next COPY_DENSE synced backwards, then one in COPY_EVERY or more: as many as keep a
#: sampled backward's own host time under COPY_BUDGET_NS a backward, spread; the estimate is the median of the last
#: COPY_KEEP samples.  A backward whose buckets do not copy as counted is counted again (not timed).
COPY_LEARN, COPY_DENSE, COPY_EVERY, COPY_BUDGET_NS, COPY_KEEP = 2, 3, 1024, 1000, 3


class DdpComm:
    """The exposed-communication split of one DDP module (see the module's text)."""

    def __init__(self, ddp: Any, param: Any) -> None:
        self.ddp = ddp
        self._inner: Any = None  # the user's hook, composed (None: DDP's own, in C++)
        self._state: Any = None
        self._core: Any = None
        self._engine: Any = None  # the core's engine while bound
        self._to_wait: Any = None  # its switch to the wait: a final callback with no Python frame
        self._spans: list[list[Any]] | bool | None = None  # this backward's sample: [launch, end] a bucket (False: not)
        self._open: tuple[list[list[Any]], Any] | None = None  # a sampled span begun: (spans, its start)
        self._synced = 0  # synced backwards split while bound
        self._pending: deque[tuple[list[list[Any]], Any, Any]] = deque()  # device samples not resolved yet
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
        if self._core is not None:
            self._core.comm.hook = name
        self._arm()  # the wait's start is a Python callback now (it ends the sampled span, after DDP's)

    def bind(self, core: Any) -> None:
        """Time into ``core``'s records from now on (None: stop; a composed hook then only forwards)."""
        self._core = core
        self._engine = core._engine if core is not None else None
        self._to_wait = partial(self._engine.switch, WAIT) if core is not None else None
        if core is not None:
            core.comm.hook = self.user_hook
            core.comm.copy = core.comm.copy or not getattr(self.ddp, "gradient_as_bucket_view", True)
            core.comm.untimed_copies = core.comm.untimed_copies or self._untimeable()
        # a deferral still live (bound anew between _split and _joined) is left to _joined, which pops and replays it
        self._spans, self._open, self._synced, self._copy_taken = None, None, 0, 0
        self.copy_host_ns = []
        self._pending.clear()
        self._device = core is not None and core.clock.kind != "host"
        self._arm()
        self._schedule(0 if self._untimeable() else COPY_LEARN)

    def _untimeable(self) -> bool:
        """``find_unused_parameters=True``: DDP's end-of-backward waits for its used-parameter map's all-reduce (and
        reads it on the host) in the middle of a bucket's copies, and the set of copies changes with the parameters
        used; the copies are not timed (they stay in ``backward.comm_wait``, and the table says so)."""
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
            hook = Arm(self._engine, BACKWARD, self.ddp, SYNCED, self._queue_callback, self._to_wait,
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
            self._queue_callback(self._to_wait if self._inner is None else self._split)

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
        engine.switch(WAIT)
        if spans:
            self._open = (spans, self._now())
        if copies and _ACTIVE[0] is not None:  # another module's copies are marked in this backward: next time
            self._schedule(1)
        elif copies and getattr(self.ddp, "find_unused_parameters", False):
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
        if copies is not None:
            _pop_mode(copies)
            if _ACTIVE[0] is copies:
                _ACTIVE[0] = None
            self._took(copies)
        engine = self._engine
        if engine is None or engine.current != WAIT:
            self._open = None
            return
        if self._open is not None:  # a composed hook's sample ends here too: its span holds the copies, as all do
            self._pending.append((*self._open, self._now()))
            self._open = None
        engine.switch(BACKWARD)
        if self._pending:
            self._resolve(engine)

    def _took(self, copies: Any) -> None:
        """A sampled end-of-backward's copies: timed (their marks to the run's estimate) if they were made as
        counted, else counted anew and timed on the next synced backward."""
        pairs = copies.pairs()
        core = self._core
        if pairs is None or core is None:
            if copies.marks and copies.clock is not None:
                copies.clock.release(copies.marks)
            self._counts = copies.counts or None
            self._schedule(1 if self._counts else COPY_EVERY)  # nothing copied: DDP copies nothing here
            return
        self._copy_taken += 1
        spent = time.perf_counter_ns() - self._copy_t0  # the sampled end-of-backward's host time, DDP's own in
        self.copy_host_ns.append(spent)
        del self.copy_host_ns[:-16]
        self._schedule(1 if self._copy_taken < COPY_DENSE else max(COPY_EVERY, -(-spent // COPY_BUDGET_NS)))
        core.comm.add_copies(self, pairs, copies.clock)

    def _resolve(self, engine: Any) -> None:
        """Sampled backwards whose events are all done (never waits), carried on the open record."""
        while self._pending:
            spans, w0, w1 = self._pending[0]
            if any(end is None for _, end in spans):
                return
            if self._device and not (w1.query() and all(end.query() for _, end in spans)):
                return
            self._pending.popleft()
            comm, prev = 0.0, -float("inf")  # ms from w0; one process group runs its collectives in order
            for launch, end in spans:
                a, b = self._ms(w0, launch), self._ms(w0, end)
                comm += max(0.0, b - max(a, prev))
                prev = max(prev, b)
            engine.add_host(COMM_MS, comm)  # a record may carry two samples: they sum, and so does their count
            engine.add_host(COMM_WAIT_MS, self._ms(w0, w1))
            engine.add_host(COMM_SAMPLES, 1.0)


def _push_mode(mode: Any) -> None:
    import torch

    torch._C._push_on_torch_dispatch_stack(mode)


def _pop_mode(mode: Any) -> None:
    """Pop ``mode`` if it is on top of the dispatch stack (DDP's end-of-backward pushed nothing of its own above
    it); else leave the stack alone and let ``mode`` pass everything through from now on."""
    import torch

    n = torch._C._len_torch_dispatch_stack()
    if n and torch._C._get_dispatch_stack_at(n - 1) is mode:
        torch._C._pop_torch_dispatch_stack(None)
    else:
        mode.passthrough = True


#: The copies marked in this process's backward (one module at a time: two DDP modules sampled in the same
#: backward would stack two modes; the second waits for its next backward).
_ACTIVE: list[Any] = [None]


_MARKER: Any = None


def _copy_marker(params: Any, counts: list[int] | None, clock: Any) -> Any:
    """A dispatch mode that watches each ``copy_`` into the ``.grad`` of one of ``params`` (DDP's copies out of its
    buckets) and makes it where DDP does.  A bucket's copies read one storage (the bucket's, or its comm hook's
    result); the mode counts them a bucket (``counts``, in DDP's order).  Given the ``counts`` an earlier backward
    made and a ``clock``, it also marks the stream before each bucket's first copy and after its last (counted), so
    the copies' time is read where they run: after their bucket's wait, beside the collectives still running, at
    the pace they are launched, with no mark between two copies.  Every other op passes through, other copies
    too: DDP reads some of its own at once (the used-parameter map it copies to the host and reads with
    ``.item()`` under ``find_unused_parameters``)."""
    global _MARKER
    if _MARKER is None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        copy_ = torch.ops.aten.copy_.default

        class CopyMarker(TorchDispatchMode):
            def __init__(self, params: Any, counts: list[int] | None, clock: Any) -> None:
                super().__init__()
                self.passthrough = False
                # the gradients' memory (their tensors may reach the mode as other Python objects)
                self.grads = {(g.data_ptr(), g.numel()) for p in params
                              if (g := p.grad) is not None and g.layout == torch.strided}
                self.expect = counts if clock is not None else None
                self.clock = clock
                self.counts: list[int] = []
                self.marks: list[Any] = []  # before a bucket's first copy, after its last: two a bucket
                self._source: Any = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
                kwargs = kwargs or {}
                if func is not copy_ or self.passthrough:
                    return func(*args, **kwargs)
                dst, src = args[0], args[1]
                if dst.layout != torch.strided or (dst.data_ptr(), dst.numel()) not in self.grads:
                    return func(*args, **kwargs)
                try:
                    counts, expect = self.counts, self.expect
                    source = src.untyped_storage().data_ptr() if src.layout == torch.strided else id(src)
                    if source != self._source or not counts:  # a bucket's first copy: its wait is enqueued before it
                        self._source = source
                        counts.append(0)
                        if expect is not None and len(self.marks) % 2 == 0 and len(counts) <= len(expect):
                            self.marks.append(self.clock.mark())
                except Exception:  # noqa: BLE001 - the timing's, never DDP's: this backward reads nothing
                    self.expect, self.counts = None, []
                out = func(*args, **kwargs)
                if not self.counts:
                    return out
                counts, expect = self.counts, self.expect
                counts[-1] += 1
                k = len(counts) - 1
                if expect is not None and k < len(expect) and counts[k] == expect[k] and len(self.marks) == 2 * k + 1:
                    try:
                        self.marks.append(self.clock.mark())  # the bucket's last copy, as counted before
                    except Exception:  # noqa: BLE001 - as above
                        self.expect = None
                return out

            def pairs(self) -> list[tuple[Any, Any]] | None:
                """Each bucket's (first mark, last mark), or None where the copies were counted only, or not as
                expected (a bucket's copies split, or a bucket more or less)."""
                self.passthrough = True
                marks = self.marks
                if self.expect is None or self.counts != self.expect or len(marks) != 2 * len(self.counts):
                    return None
                return list(zip(marks[::2], marks[1::2]))

        _MARKER = CopyMarker
    return _MARKER(params, counts, clock)


#: Each DDP module's split (weak: a module dropped takes its entry along); none is an attribute of the module,
#: which stays picklable and deep-copyable (an EMA copy of it).
_PROBES: weakref.WeakKeyDictionary[Any, DdpComm] = weakref.WeakKeyDictionary()
#: DDP's two registrations, wrapped while a split module lives; DDP's own, which ``_compose`` calls past ours.
_DDP_PATCHES = Patches()
_DDP_OWN: dict[str, Any] = {}


def _between_marks(engine: Any, phase: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` labelled ``phase``'s wait for collectives (``<phase>.comm_wait``), back to ``phase``
    after it, whatever it raises."""
    engine.switch(comm_label(phase))
    try:
        return fn(*args, **kwargs)
    finally:
        engine.switch(phase)


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


def attach_comm(models: Any, core: Any) -> list[Any]:
    """The communication splits of ``models`` into ``core``: each DDP module's, and FSDP2's once if any is sharded
    with ``fully_shard``.  Each has ``remove()``."""
    probes: list[Any] = [p for p in (attach_ddp(m, core) for m in models) if p is not None]
    fsdp = FsdpComm.attach(models, core)
    if fsdp is not None:
        probes.append(fsdp)
    return probes


# -- FSDP2 ------------------------------------------------------------------------------------------
def _device_index(fn: Any) -> int | None:
    """The position of ``fn``'s ``device`` parameter (None: no such function, or no such parameter)."""
    import inspect

    try:
        return list(inspect.signature(fn).parameters).index("device")
    except (TypeError, ValueError):
        return None


def _host_blocking(issue: Any, at: int, engines: list[Any]) -> Any:
    """``issue`` (FSDP2's all-gather or reduce-scatter), between two marks when its group is on the CPU: there
    the collective runs on the host, in the call (on a GPU it is only enqueued on FSDP2's own streams)."""

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        engine = engines[-1] if engines else None
        phase = engine.current if engine is not None else None
        device = args[at] if len(args) > at else kwargs.get("device")
        if (phase != "forward" and phase != BACKWARD) or getattr(device, "type", None) != "cpu":
            return issue(*args, **kwargs)
        return _between_marks(engine, phase, issue, *args, **kwargs)

    return functools.update_wrapper(timed, issue)


def _rs_waits(group: Any) -> list[Any]:
    """The reduce-scatter events FSDP2's ``post_backward`` is about to make the compute stream wait for (before it
    launches the group's own reduce-scatter: a bound on the buffers in flight), as this torch's FSDP2 decides."""
    ctx = getattr(group, "comm_ctx", None)
    if ctx is None or not getattr(group, "reduce_grads", True):  # FSDP2 returns before its wait then
        return []
    states = getattr(ctx, "reduce_scatter_states", None)
    if states is not None:  # a list: torch >= 2.10
        if getattr(group, "_param_group_index", 0) != getattr(group, "_num_param_groups", 1) - 1:
            return []
        keep = getattr(ctx, "reduce_scatter_max_input_buffers", None)
        n = len(states) if not keep else len(states) - keep + 1  # FSDP2 pops the oldest until fewer than keep
        return [s.event for s in states[:max(0, n)] if getattr(s, "event", None) is not None]
    return []  # one state (older torch): FSDP2 waits only for a group with gradients; that wait stays in backward


def _wait_early(events: list[Any], work: Any = None) -> None:
    """An FSDP2 wait, made early: the compute (current) stream waits for each event; an async group's work (a
    CPU's: the host waits).  FSDP2's own wait then returns at once."""
    for event in events:
        event.wait()
    if work is not None and hasattr(work, "wait"):
        work.wait()


class FsdpComm:
    """FSDP2's (``fully_shard``) exposed waits: each all-gather's in ``forward`` and ``backward``, and the
    reduce-scatters' tail at backward's end.

    FSDP2 makes the compute stream wait for a group's all-gather (its event; a CPU group's work, the host)
    just before copying the gathered parameters out (``foreach_all_gather_copy_out``): phase-timer makes that
    same wait a moment earlier, between two marks (``forward.comm_wait`` or ``backward.comm_wait``), and the
    copy-out, FSDP2's own compute, follows outside them.  Likewise each group's ``post_backward`` first makes the
    compute stream wait for the earlier reduce-scatters still in flight (FSDP2's bound on their buffers): that
    wait, made a moment earlier between two marks, is ``backward.comm_wait`` too.  At backward's end FSDP2's root final callback makes
    the compute stream wait for the reduce-scatters (and for any group's all-reduce): it runs between two marks
    (``backward.comm_wait``).  It also runs the post-backward of a group whose own never fired (the root's,
    whose inputs need no gradient: its reduce-scatter launch and copy-in), which is then in that span.  Two marks an all-gather and two a
    backward: an FSDP2 module of N groups adds ~4N marks a step, beside FSDP2's own Python of each group.

    FSDP2's functions are wrapped once in the process (they are shared by every FSDP2 module), and put back
    when the last timer lets go; they time into the newest bound timer.
    """

    _engines: list[Any] = []
    _patches = Patches()

    def __init__(self, core: Any) -> None:
        self._engine = core._engine

    @classmethod
    def attach(cls, models: Any, core: Any) -> FsdpComm | None:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            return None
        if not any(isinstance(m, FSDPModule) for model in models for m in model.modules()):
            return None
        if not cls._patches:
            why = cls._wrap()
            if why is not None:
                warn(log, f"phase-timer: FSDP2's waits for its collectives are not split out (comm_wait): {why}.", 3)
                return None
        probe = cls(core)
        cls._engines.append(probe._engine)
        core.signals.fsdp2 = True  # COMM_BOUND's advice is FSDP2's
        return probe

    def remove(self, core: Any = None) -> None:
        """Stop timing into this probe's core (``core``: only if it is that one); FSDP2's functions are put back
        when no timer is left."""
        if core is not None and core._engine is not self._engine:
            return
        engines = type(self)._engines
        if self._engine in engines:
            engines.remove(self._engine)
        if not engines:
            type(self)._unwrap()

    @classmethod
    def _wrap(cls) -> str | None:
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod
            from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

            copy_out = group_mod.foreach_all_gather_copy_out
            final = FSDPState._root_post_backward_final_callback
        except (ImportError, AttributeError) as err:  # a torch whose FSDP2 is laid out otherwise
            return f"this torch's FSDP2 has no {err}"
        engines = cls._engines

        def timed_copy_out(result, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            engine = engines[-1] if engines else None
            phase = engine.current if engine is not None else None
            if phase == "forward" or phase == BACKWARD:
                event, work = getattr(result, "all_gather_event", None), getattr(result, "all_gather_work", None)
                if event is not None or work is not None:
                    _between_marks(engine, phase, _wait_early, [event] if event is not None else [], work)
            return copy_out(result, *args, **kwargs)

        def timed_final(state):  # noqa: ANN001, ANN202
            engine = engines[-1] if engines else None
            if engine is None or engine.current != BACKWARD:
                return final(state)
            return _between_marks(engine, BACKWARD, final, state)

        functools.update_wrapper(timed_copy_out, copy_out)
        functools.update_wrapper(timed_final, final)
        cls._patches.replace(group_mod, "foreach_all_gather_copy_out", timed_copy_out)
        cls._patches.replace(FSDPState, "_root_post_backward_final_callback", timed_final)
        post_backward = getattr(getattr(group_mod, "FSDPParamGroup", None), "post_backward", None)
        if post_backward is not None:  # the compute stream's wait for earlier reduce-scatters, in backward

            def timed_post_backward(group, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                engine = engines[-1] if engines else None
                if engine is not None and engine.current == BACKWARD:
                    events = _rs_waits(group)
                    if events:
                        _between_marks(engine, BACKWARD, _wait_early, events)
                return post_backward(group, *args, **kwargs)

            functools.update_wrapper(timed_post_backward, post_backward)
            cls._patches.replace(group_mod.FSDPParamGroup, "post_backward", timed_post_backward)
        for name in ("foreach_all_gather", "foreach_reduce"):  # a CPU group's collectives block the host there
            issue = getattr(group_mod, name, None)
            at = _device_index(issue)
            if at is not None:
                cls._patches.replace(group_mod, name, _host_blocking(issue, at, engines))
        return None

    @classmethod
    def _unwrap(cls) -> None:
        cls._patches.put_back()


def copy_note(run: RunComm) -> str | None:
    """What the table says of DDP's copies inside the wait's span (None: none timed, none expected)."""
    if run.copy_ms is not None:
        return (f"DDP's copies into .grad ({run.copy_ms:.3f} ms a synced backward, timed where they run on "
                f"{run.copy_samples} sampled backwards) are backward's and are taken off backward.comm_wait")
    if run.copy and run.untimed_copies:
        return ("DDP's copies into .grad are inside backward.comm_wait (find_unused_parameters=True: its wait for the "
                "used-parameter map falls among them, so they are not timed)")
    if run.copy:
        return "DDP's copies into .grad are inside backward.comm_wait (no backward was sampled to time them)"
    return None


def line(run: RunComm) -> str | None:
    """The table's line: the collectives' own time, their exposed wait, the share hidden, and what the span holds
    besides the wait (None: nothing sampled and nothing to say)."""
    c = run.as_dict()
    note = copy_note(run)
    if c is None:
        return f"communication (DDP): {note}" if note else None
    hidden = c.get("hidden_share")
    return (f"communication (DDP, {c['samples']} sampled backwards): collectives {c['collectives_ms']:.3f} ms a step, "
            f"exposed {c['exposed_ms']:.3f} ms (backward.comm_wait)"
            + (f", {100 * hidden:.0f}% hidden behind backward's compute" if hidden is not None else "")
            + (f"; your comm hook {run.hook} composed" if run.hook else "")
            + (f"; {note}" if note else ""))


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


def split(columns: dict[str, list[float]]) -> dict[str, float]:
    """Take the sampled communication out of a window's columns: ``{comm_ms, comm_wait_ms, comm_samples}``
    summed over the sampled backwards its records carry (empty when none)."""
    got = {name: columns.pop(name, None) for name in CARRIED}
    if not all(got.values()):
        return {}
    return {name: float(sum(values)) for name, values in got.items()}


def hidden_share(comm: dict[str, float]) -> float | None:
    """1 - exposed / communication over the same sampled backwards (None: no communication sampled)."""
    total = comm.get(COMM_MS, 0.0)
    if total <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - comm.get(COMM_WAIT_MS, 0.0) / total))


def scalars(comm: dict[str, float]) -> dict[str, float]:
    """A window's ``comm/collectives_ms`` (mean over its sampled backwards) and ``comm/hidden_share``."""
    n = comm.get(COMM_SAMPLES, 0.0)
    if not n:
        return {}
    out = {f"{PREFIX}/collectives_ms": comm[COMM_MS] / n}
    hidden = hidden_share(comm)
    if hidden is not None:
        out[f"{PREFIX}/hidden_share"] = hidden
    return out


class RunComm:
    """The run's sampled communication: summed over every window; and DDP's copies inside the wait's span."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}
        #: The user's comm hook (its name), or None: DDP's own average.
        self.hook: str | None = None
        #: A DDP module split copies its results into ``.grad`` inside the span (``gradient_as_bucket_view=False``).
        self.copy = False
        self._copy_pending: deque[tuple[int, list[tuple[Any, Any]], Any]] = deque()
        self._copy_samples: dict[int, list[float]] = {}  # a module's split (its id) -> its last samples, ms
        #: DDP's copies as they run in its end-of-backward (each bucket's, from before its first copy to after
        #: its last, summed), taken off ``backward.comm_wait``: ms a synced backward (the modules' medians, summed),
        #: or None.
        self.copy_ms: float | None = None
        self.copy_samples = 0
        #: A module whose copies are never timed (``find_unused_parameters=True``): they stay in the wait.
        self.untimed_copies = False

    def add(self, comm: dict[str, float]) -> None:
        for k, v in comm.items():
            self.counts[k] = self.counts.get(k, 0.0) + v

    def add_copies(self, probe: Any, pairs: list[tuple[Any, Any]], clock: Any) -> None:
        """One sampled end-of-backward's copies: each bucket's two marks."""
        self._copy_pending.append((id(probe), pairs, clock))

    def resolve_copies(self) -> None:
        """The sampled copies whose marks are done (``clock.done``: a query, never a wait), into :attr:`copy_ms`."""
        pending = self._copy_pending
        while pending:
            key, pairs, clock = pending[0]
            if not clock.done(pairs[-1][1]):
                return
            pending.popleft()
            kept = self._copy_samples.setdefault(key, [])
            kept.append(sum(clock.elapsed_ms(a, b) for a, b in pairs))
            clock.release([m for pair in pairs for m in pair])
            del kept[:-COPY_KEEP]
            self.copy_samples += 1
            self.copy_ms = sum(statistics.median(v) for v in self._copy_samples.values())

    def take_copies(self, columns: dict[str, list[float]], comm: dict[str, float]) -> None:
        """Take DDP's copies off a window's ``backward.comm_wait`` (each step's, never below zero; sorted stays
        sorted) and off its sampled exposed wait."""
        self.resolve_copies()
        copy = self.copy_ms
        if not copy:
            return
        waits = columns.get(WAIT)
        if waits:
            columns[WAIT] = [v - copy if v > copy else 0.0 for v in waits]
        if comm.get(COMM_SAMPLES):
            comm[COMM_WAIT_MS] = max(0.0, comm[COMM_WAIT_MS] - copy * comm[COMM_SAMPLES])

    def take_copy(self, ms: dict[str, float]) -> None:
        """The same off one step's phases (its own line in the sinks)."""
        if self._copy_pending:
            self.resolve_copies()
        copy = self.copy_ms
        wait = ms.get(WAIT) if copy else None
        if wait is not None:
            ms[WAIT] = wait - copy if wait > copy else 0.0

    def as_dict(self) -> dict[str, float] | None:
        n = self.counts.get(COMM_SAMPLES, 0.0)
        if not n:
            return None
        out = {"collectives_ms": self.counts[COMM_MS] / n, "exposed_ms": self.counts[COMM_WAIT_MS] / n,
               "samples": int(n)}
        hidden = hidden_share(self.counts)
        if hidden is not None:
            out["hidden_share"] = hidden
        return out
