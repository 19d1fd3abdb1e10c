"""FSDP2's (``fully_shard``) exposed waits for its all-gathers and reduce-scatters, made between two marks."""

from __future__ import annotations

import functools
import logging
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
