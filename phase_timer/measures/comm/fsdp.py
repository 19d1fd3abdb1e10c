"""FSDP2's (``fully_shard``) exposed waits for its all-gathers and reduce-scatters, made between two marks."""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from phase_timer._env import warn
from phase_timer.patches import Patches
from phase_timer.phases import BACKWARD, comm_label

log = logging.getLogger(__name__)


def _between_marks(engine: Any, phase: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` labelled ``phase``'s wait for collectives (``<phase>.comm_wait``), back to ``phase``
    after it, whatever it raises."""
    engine.switch(comm_label(phase))
    try:
        return fn(*args, **kwargs)
    finally:
        engine.switch(phase)



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


def _has_grad(group: Any) -> bool:
    """Whether FSDP2's ``post_backward`` finds a gradient to reduce in ``group`` (it returns before its wait
    otherwise, in a torch whose wait comes after that check)."""
    for param in getattr(group, "fsdp_params", ()):
        if not hasattr(param, "_unsharded_param"):
            continue
        if getattr(param, "unsharded_accumulated_grad", None) is not None:
            return True
        if getattr(getattr(param, "unsharded_param", None), "grad", None) is not None:
            return True
    return False


def _own_waits(group: Any) -> list[Any]:
    """The events of ``group``'s own earlier reduction FSDP2 waits for before reducing again or finalizing
    (``_wait_for_post_backward``): its post-reduce event and its all-reduce's."""
    events = [getattr(group, "_post_reduce_event", None), getattr(getattr(group, "_all_reduce_state", None), "event", None)]
    return [e for e in events if e is not None]


def _rs_waits(group: Any) -> list[Any]:
    """The events FSDP2's ``post_backward`` is about to make the compute stream wait for before it launches the
    group's own reduce-scatter, as this torch's FSDP2 decides: the earlier reduce-scatters (a bound on the buffers in
    flight) and the group's own earlier reduction."""
    ctx = getattr(group, "comm_ctx", None)
    if ctx is None or not getattr(group, "reduce_grads", True):  # FSDP2 returns before its wait then
        return []
    states = getattr(ctx, "reduce_scatter_states", None)
    if states is not None:  # a list (torch 2.13): waited for by the last param group, gradients or not
        out: list[Any] = []
        if getattr(group, "_param_group_index", 0) == getattr(group, "_num_param_groups", 1) - 1:
            keep = getattr(ctx, "reduce_scatter_max_input_buffers", None)
            n = len(states) if not keep else len(states) - keep + 1  # FSDP2 pops the oldest until fewer than keep
            out = [s.event for s in states[:max(0, n)] if getattr(s, "event", None) is not None]
        return out + _own_waits(group) if _has_grad(group) else out
    if not _has_grad(group):  # one state (torch 2.11 and before): waited for by a group with gradients only
        return []
    event = getattr(getattr(ctx, "reduce_scatter_state", None), "event", None)
    return ([event] if event is not None else []) + _own_waits(group)


def _finalize_waits(group: Any) -> tuple[list[Any], Any]:
    """The events (and an async group's work) FSDP2's ``finalize_backward`` makes the compute stream wait for, at
    backward's end: the group's own reduction (the reduce-scatter its post-reduce event follows), every stream's
    last post-reduce event (torch 2.13), an all-gather never waited for."""
    events = _own_waits(group)
    last = getattr(getattr(group, "comm_ctx", None), "_last_post_reduce_events", None)
    if last:
        events += [e for e in last.values() if e is not None]
    gathered = getattr(group, "_all_gather_result", None)
    event = getattr(gathered, "all_gather_event", None)
    if event is not None:
        events.append(event)
    return events, getattr(gathered, "all_gather_work", None)


def _undone(events: list[Any]) -> list[Any]:
    """The events the device has not yet reached (a query each, never a wait): a wait for the others cannot hold the
    compute stream, and marks around it would time only the host's pace where the device idles."""
    return [e for e in events if not e.query()]


def _current_stream(events: list[Any]) -> Any:
    """The stream FSDP2 waits on (the current one), for CUDA events; None (each event's own default) otherwise.
    Fetched before the wait's first mark: its Python (microseconds) would otherwise sit between the two marks, and
    where the device keeps pace with its host a span holds the host's time between its marks."""
    import torch

    return torch.cuda.current_stream() if events and isinstance(events[0], torch.cuda.Event) else None


def _wait_early(events: list[Any], work: Any = None, stream: Any = None) -> None:
    """An FSDP2 wait, made early: ``stream`` (None: the current one) waits for each event; an async group's work (a
    CPU's: the host waits).  FSDP2's own wait then returns at once."""
    for event in events:
        event.wait(stream)
    if work is not None and hasattr(work, "wait"):
        work.wait()


def _defers(copy_out: Any) -> bool:
    """Whether ``copy_out`` is torch's own FSDP2 copy-out, whose first kernel is the split copy it calls by name: only
    there may its wait be left to the split copy (a copy-out of someone else's, or one that launches anything else
    first, keeps the wait at its start)."""
    import inspect

    if getattr(copy_out, "__module__", None) != _COLLECTIVES:
        return False
    try:
        return "torch.ops.fsdp.split_with_sizes_copy(" in inspect.getsource(copy_out)
    except (OSError, TypeError):
        return False


#: Where torch's FSDP2 defines its copy-out.
_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


class _SplitCopy:
    """FSDP2's split copy (``torch.ops.fsdp.split_with_sizes_copy``), the first kernel a copy-out launches: the
    copy-out's wait for its all-gather, left pending in ``late`` (by thread) by the copy-out, is made just before it,
    between two marks.  Anything else asked of it (``.default``, an overload) is the op's, and makes no wait."""

    def __init__(self, op: Any, late: dict[int, Any]) -> None:
        self._op, self._late = op, late

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._late:
            self.wait(self._late)
        return self._op(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    @staticmethod
    def wait(late: dict[int, Any]) -> bool:
        """This thread's pending wait made (False: none pending)."""
        entry = late.pop(threading.get_ident(), None)
        if entry is None:
            return False
        engine, phase, events, stream = entry
        _between_marks(engine, phase, _wait_early, events, None, stream)
        return True

    @classmethod
    def wrap(cls, patches: Patches, late: dict[int, Any]) -> _SplitCopy | None:
        """Put in place (None: this torch has no such op; the copy-out's wait is then made at its start)."""
        try:
            import torch

            ops = torch.ops.fsdp
            op = ops.split_with_sizes_copy
        except (AttributeError, RuntimeError):
            return None
        wrapped = cls(op, late)
        patches.replace(ops, "split_with_sizes_copy", wrapped)
        return wrapped


class FsdpComm:
    """FSDP2's (``fully_shard``) exposed waits: each all-gather's in ``forward`` and ``backward``, and the
    reduce-scatters' tail at backward's end.

    FSDP2 makes the compute stream wait for a group's all-gather (its event; a CPU group's work, the host)
    at the start of copying the gathered parameters out (``foreach_all_gather_copy_out``), then runs the copy-out's
    Python (each parameter's outputs made, tens to hundreds of µs a group) before its first kernel, the split copy:
    phase-timer makes that wait itself, between two marks (``forward.comm_wait`` or ``backward.comm_wait``), just
    before the split copy (FSDP2 handed the result without its event), and the copy-out's kernels follow outside
    them.  On a device that keeps pace with its host, a wait made at the copy-out's start holds the stream from
    there, while the host still runs that Python: a collective ending meanwhile would cost the step nothing, and
    its marks would count it (2 x H200, FSDP2 on a host-paced rank: 1.3-3.4 ms a step over the blocked rule, on the
    steps whose all-gathers ended in that Python).  Where the device is behind, the place is the same in the
    stream's order (no kernel between).  (Without the op, with a copy-out not torch's own (one that may launch
    something else first), or with an async group's work (a CPU group's), the wait is made at the copy-out's start; a
    copy-out that returns without its split copy has its wait made then, a warning, and its later waits at its start.)  Likewise each group's ``post_backward`` first makes the
    compute stream wait for earlier reduce-scatters (FSDP2's bound on their buffers: the one state of torch 2.11,
    for a group with gradients; the oldest of torch 2.13's list) and for its own earlier reduction; and at
    backward's end each group's ``finalize_backward`` (inside FSDP2's root final callback) waits for its own
    reduction, the last reduce-scatter's among them: each such wait, made a moment earlier between two marks, is
    ``backward.comm_wait`` too.  A wait for events the device has already passed (a query each, never a wait) gets no
    marks: it cannot hold the compute stream, and its marks would time only the host's pace on an idle device.  Where
    the device keeps pace with its host, a span still holds the host's time between its two marks: the stream is
    looked up before the first, so that only the stream's waits (a driver call each) lie between them.  The
    final callback's own Python (the root group's post-backward and reduce-scatter launch, the groups' reshards) is
    ``backward``'s.  At most two marks an all-gather and two a reduce-scatter wait: an FSDP2 module of N groups adds
    up to ~6N marks a step, beside FSDP2's own Python of each group.

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

            copy_out = group_mod.foreach_all_gather_copy_out
            finalize = group_mod.FSDPParamGroup.finalize_backward
        except (ImportError, AttributeError) as err:  # a torch whose FSDP2 is laid out otherwise
            return f"this torch's FSDP2 has no {err}"
        engines = cls._engines

        late: dict[int, tuple[Any, str, list[Any], Any]] = {}  # each thread's copy-out wait, for its split copy
        defer = [_defers(copy_out) and _SplitCopy.wrap(cls._patches, late) is not None]

        def timed_copy_out(result, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            engine = engines[-1] if engines else None
            phase = engine.current if engine is not None else None
            if phase == "forward" or phase == BACKWARD:
                event, work = getattr(result, "all_gather_event", None), getattr(result, "all_gather_work", None)
                events = _undone([event]) if event is not None else []
                if events and work is None and defer[0] and hasattr(result, "_replace"):
                    late[threading.get_ident()] = (engine, phase, events, _current_stream(events))
                    raised = True
                    try:  # FSDP2 leaves the wait to the split copy's (its event taken out of its hands)
                        out = copy_out(result._replace(all_gather_event=None), *args, **kwargs)
                        raised = False
                        return out
                    finally:
                        if _SplitCopy.wait(late) and not raised:  # returned with no split copy: from now on at its start
                            defer[0] = False
                            warn(log, "phase-timer: FSDP2's copy-out returned without its split copy; its waits for "
                                 "all-gathers are made at its start from now on.", 3)
                if events or work is not None:
                    _between_marks(engine, phase, _wait_early, events, work, _current_stream(events))
            return copy_out(result, *args, **kwargs)

        def timed_finalize(group, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            engine = engines[-1] if engines else None
            if engine is not None and engine.current == BACKWARD:
                events, work = _finalize_waits(group)
                events = _undone(events)
                if events or work is not None:
                    _between_marks(engine, BACKWARD, _wait_early, events, work, _current_stream(events))
            return finalize(group, *args, **kwargs)

        functools.update_wrapper(timed_copy_out, copy_out)
        functools.update_wrapper(timed_finalize, finalize)
        cls._patches.replace(group_mod, "foreach_all_gather_copy_out", timed_copy_out)
        cls._patches.replace(group_mod.FSDPParamGroup, "finalize_backward", timed_finalize)
        post_backward = getattr(getattr(group_mod, "FSDPParamGroup", None), "post_backward", None)
        if post_backward is not None:  # the compute stream's wait for earlier reduce-scatters, in backward

            def timed_post_backward(group, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                engine = engines[-1] if engines else None
                if engine is not None and engine.current == BACKWARD:
                    events = _undone(_rs_waits(group))
                    if events:
                        _between_marks(engine, BACKWARD, _wait_early, events, None, _current_stream(events))
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
