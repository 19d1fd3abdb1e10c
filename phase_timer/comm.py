"""Exposed communication: how much of ``backward`` waits for DDP's all-reduce, every step, with no sync.

DDP launches each gradient bucket's all-reduce from its *comm hook*, on the autograd thread, as the
bucket's last gradient is computed; at the end of backward it makes the compute stream wait for every
bucket's future, then copies the results into ``.grad``.  What the network costs the step is that wait:
the time the compute stream spends waiting for collectives it could not hide behind backward's compute.

:class:`DdpComm` puts a comm hook of its own on the DDP module, which *composes* with the user's: it calls
the user's hook (PowerSGD, fp16 compression, their own; registered before or after phase-timer's, through
the module's own ``register_comm_hook``) or, without one, the same average DDP computes itself (an
all-reduce pre-multiplied by ``1/world``: on NCCL in the collective's own kernel, no extra kernel).  At the
last bucket it queues an autograd callback, which the engine runs after all of backward's compute and
before DDP's own end-of-backward: there, between two marks on the compute stream (``backward.comm_wait``),
the compute stream waits for the last bucket's future, the wait DDP's end-of-backward would make at that
very point.  So the span is exactly the exposed wait (the copy into ``.grad`` after it stays ``backward``'s),
and it is part of ``backward`` (``metrics.part_of``): the phases still add up to ``step``.  One mark pair,
one queued callback and one stream wait a synced backward: a ``no_sync()`` micro-batch calls no hook, and
has none.

The collectives' own time (for the hidden share, ``1 - exposed / communication``) needs an event per bucket:
on sampled backwards only (the first 8, then one in 16; every one on the host clock), each bucket's
collective from its launch (or the previous one's end, whichever is later: one process group runs them in
order) to its future's completion, read off the training thread.  The samples resolve a few steps later, and
ride on the record then open as carried values (``comm_ms``, ``comm_wait_ms``: the same sampled steps' wait).

Where the split cannot be made, it says so once and the run goes on unsplit: a comm hook registered on the
module before phase-timer saw it (its callable is inside DDP's C++ reducer, where nothing can wrap it: attach
first, or hand Lightning's DDPStrategy its ``ddp_comm_hook``, which phase-timer wraps); a static graph's
delayed all-reduce (it runs inside DDP's own end-of-backward, after the marks).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Any

from phase_timer._env import warn
from phase_timer.metrics import comm_label

log = logging.getLogger(__name__)

BACKWARD = "backward"
WAIT = comm_label(BACKWARD)
#: Carried on a record (sampled): the collectives' own time of a sampled synced backward, and its exposed wait.
COMM_MS, COMM_WAIT_MS, COMM_SAMPLES = "comm_ms", "comm_wait_ms", "comm_samples"
CARRIED = (COMM_MS, COMM_WAIT_MS, COMM_SAMPLES)
#: Device clock: the collectives' own time on the first DENSE backwards, then one in EVERY.
DENSE, EVERY = 8, 16
PREFIX = "comm"


def _first(fut: Any) -> Any:
    return fut.value()[0]


class DdpComm:
    """The exposed-communication split of one DDP module (see the module's text)."""

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        self._inner: Any = self._average
        self._state: Any = None
        self._core: Any = None
        self._last: Any = None  # the last bucket's future, this backward
        self._spans: list[list[Any]] | bool | None = None  # a sampled backward: [launch, end] per bucket (False: not)
        self._synced = 0  # synced backwards seen while bound
        self._pending: deque[tuple[list[list[Any]], Any, Any]] = deque()  # device samples not resolved yet
        self._device = False
        self._opts: Any = None  # the default all-reduce's options, made at the first bucket
        self._group: Any = None
        self._scale = 1.0
        self._complex = False
        self.user_hook: str | None = None  # the name of the user's hook composed, if any
        import torch
        from torch.autograd import Variable

        self._event = partial(torch.cuda.Event, enable_timing=True)
        self._queue_callback = Variable._execution_engine.queue_callback  # once a synced backward: bound here

    # -- installation ---------------------------------------------------------------
    @classmethod
    def install(cls, ddp: Any) -> tuple[DdpComm | None, str | None]:
        """Put the composing hook on ``ddp`` (once: a module already split returns its own); or None and why not."""
        own = getattr(ddp, "_phase_timer_comm", None)
        if isinstance(own, DdpComm):
            return own, None
        if getattr(ddp, "_comm_hooks", None):
            name = getattr(ddp._comm_hooks[0][0], "__qualname__", "a comm hook")
            return None, (f"its comm hook {name} was registered before phase-timer saw the model, inside DDP where "
                          "nothing can wrap it; attach phase-timer before register_comm_hook() and it composes")
        try:
            builtin = ddp._get_ddp_logging_data().get("comm_hook")
        except Exception:  # noqa: BLE001 - an older DDP: no name to read
            builtin = None
        if builtin:
            return None, f"a built-in comm hook ({builtin}) was registered before phase-timer saw the model"
        probe = cls(ddp)
        try:
            type(ddp).register_comm_hook(ddp, None, probe._hook)
        except Exception as err:  # noqa: BLE001 - e.g. a DDP variant without comm hooks: unsplit, the run goes on
            return None, f"its comm hook could not be set ({type(err).__name__}: {err})"
        ddp._comm_hooks.clear()  # DDP's record of Python hooks: the user's, composed, goes there (not ours)
        ddp.register_comm_hook = probe._register_user
        ddp._register_builtin_comm_hook = probe._register_builtin
        ddp._phase_timer_comm = probe
        return probe, None

    def _register_user(self, state: object, hook: Any) -> None:
        """The module's ``register_comm_hook``: the user's hook runs inside ours (DDP's checks and record kept)."""
        self._once()
        self.ddp._check_comm_hook(hook)
        self.ddp._comm_hooks.append((hook, state))
        self._compose(hook, state, getattr(hook, "__qualname__", repr(hook)))

    def _register_builtin(self, comm_hook_type: Any) -> None:
        """The module's ``_register_builtin_comm_hook``: DDP's built-ins, as their Python twins inside ours."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self._once()
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            hook, state = default_hooks.fp16_compress_hook, self.ddp.process_group
        elif comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            hook, state = self._average, None
        else:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}")
        self._compose(hook, state, str(comm_hook_type))

    def _once(self) -> None:
        if self.user_hook is not None:  # DDP's own rule, with its words
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")

    def _compose(self, hook: Any, state: object, name: str) -> None:
        """Run ``hook`` inside ours from now on, under ``name`` (DDP's logging and the run's record say it)."""
        logger = getattr(self.ddp, "logger", None)
        if logger is not None:
            logger._set_comm_hook_name(name)
        self._inner, self._state, self.user_hook = hook, state, name
        if self._core is not None:
            self._core.comm.hook = name

    def bind(self, core: Any) -> None:
        """Time into ``core``'s records from now on (None: stop; the hook then only forwards)."""
        self._core = core
        if core is not None:
            core.comm.hook = self.user_hook
        self._last, self._spans, self._synced = None, None, 0
        self._pending.clear()
        self._device = core is not None and core.clock.kind != "host"

    # -- the hook (autograd thread) -----------------------------------------------------
    def _average(self, _state: object, bucket: Any) -> Any:
        """What DDP does without a hook: the bucket's all-reduce, averaged over the ranks (the process group's
        own call, its options made once: ``dist.all_reduce``'s checks cost ~15 µs a bucket)."""
        buf = bucket.buffer()
        opts = self._opts
        if opts is None:
            opts = self._options(buf)
        if self._scale != 1.0:
            buf.mul_(self._scale)
        if self._complex:  # the collective reduces complex numbers as pairs of reals (as dist.all_reduce does)
            import torch

            return self._group.allreduce([torch.view_as_real(buf)], opts).get_future().then(lambda _f: buf)
        return self._group.allreduce([buf], opts).get_future().then(_first)

    def _options(self, buf: Any) -> Any:
        import torch.distributed as dist

        group = self._group = self.ddp.process_group
        n = group.size()
        opts = dist.AllreduceOptions()
        opts.asyncOp = True
        self._complex = buf.is_complex()
        if buf.is_cuda and not self._complex and dist.get_backend(group) == "nccl":
            # the scale inside NCCL's kernel: no kernel of ours, the same product DDP's copy into the bucket makes
            opts.reduceOp = dist._make_nccl_premul_sum(1.0 / n)
            self._scale = 1.0
        else:  # DDP scales the gradients as it copies them into the bucket; the same product here
            opts.reduceOp = dist.ReduceOp.SUM
            self._scale = 1.0 / n
        self._opts = opts
        return opts

    def _hook(self, _state, bucket):  # noqa: ANN001, ANN202 - no annotations: DDP checks them against its own types
        core = self._core
        if core is None or core.closed:
            return self._inner(self._state, bucket)
        spans = self._spans
        if spans is None:  # this backward's first bucket: a sampled one? (a timed step's only)
            spans = self._spans = [] if core._engine.current == BACKWARD and self._sampled() else False
        launch = self._now() if spans is not False else None
        fut = self._inner(self._state, bucket)
        if spans is not False:
            span = [launch, None]
            spans.append(span)
            fut.add_done_callback(partial(self._ended, span))
        if bucket.is_last():
            self._last = fut
            try:  # runs after all of backward's compute, before DDP's end-of-backward (queued later)
                self._queue_callback(self._wait)
            except RuntimeError:  # not inside a backward (a delayed all-reduce): unsplit
                self._last = self._spans = None
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

    # -- the wait (autograd's final callbacks) ----------------------------------------------
    def _wait(self) -> None:
        fut, self._last = self._last, None
        spans, self._spans = self._spans, None
        core = self._core
        if fut is None or core is None or core.closed:
            return
        spans = spans or None  # False: not sampled
        engine = core._engine
        split = engine.current == BACKWARD  # a record open, in backward (not paused, no user phase open)
        if split:
            self._synced += 1  # a timed synced backward: the sampling schedule counts these
            engine.switch(WAIT)
        w0 = self._now() if spans else None
        try:
            fut.wait()  # CUDA: the compute stream waits for the future's events (no host wait); CPU: the host waits
        except Exception:  # noqa: BLE001 - DDP's own wait, next, raises it with its own message
            pass
        w1 = self._now() if spans else None
        if split:
            engine.switch(BACKWARD)
        if spans:
            self._pending.append((spans, w0, w1))
        if self._pending and engine.is_open:
            self._resolve(engine)

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


def line(run: RunComm) -> str | None:
    """The table's line: the collectives' own time, their exposed wait, the share hidden (None: none sampled)."""
    c = run.as_dict()
    if c is None:
        return None
    hidden = c.get("hidden_share")
    return (f"communication (DDP, {c['samples']} sampled backwards): collectives {c['collectives_ms']:.3f} ms a step, "
            f"exposed {c['exposed_ms']:.3f} ms (backward.comm_wait)"
            + (f", {100 * hidden:.0f}% hidden behind backward's compute" if hidden is not None else "")
            + (f"; your comm hook {run.hook} composed" if run.hook else ""))


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
    """The run's sampled communication: summed over every window."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}
        #: The user's comm hook composed (its name), or None: phase-timer's own average.
        self.hook: str | None = None

    def add(self, comm: dict[str, float]) -> None:
        for k, v in comm.items():
            self.counts[k] = self.counts.get(k, 0.0) + v

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
