"""Which FSDP2 waits phase-timer makes early between marks, as each torch's FSDP2 decides them (torch 2.11's one
reduce-scatter state, torch 2.13's list), on stand-ins for FSDP2's objects: the real ones need two processes
(``tests/measures/comm/test_comm.py`` runs them on gloo) and the real waits two GPUs (``benchmarks/comm_nccl.py``)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from phase_timer.measures.comm.fsdp import _between_marks, _current_stream, _finalize_waits, _rs_waits, _undone, _wait_early


class Event:
    def __init__(self, name: str, done: bool = False, log: list | None = None) -> None:
        self.name, self.done, self.log = name, done, log

    def wait(self, stream: object = None) -> None:
        self.log.append(("wait", self.name, stream))

    def query(self) -> bool:
        return self.done

    def __repr__(self) -> str:
        return self.name


def param(grad: bool = True, accumulated: bool = False, unsharded: bool = True) -> NS:
    p = NS(unsharded_accumulated_grad=object() if accumulated else None,
           unsharded_param=NS(grad=object() if grad else None))
    if unsharded:
        p._unsharded_param = p.unsharded_param
    return p


def group(ctx: NS, params: list, **kw: object) -> NS:
    return NS(comm_ctx=ctx, fsdp_params=params, reduce_grads=kw.pop("reduce_grads", True),
              _post_reduce_event=kw.pop("post_reduce", None), _all_reduce_state=kw.pop("all_reduce", None),
              _all_gather_result=kw.pop("gathered", None), **kw)


def test_torch_2_11_waits_for_the_one_reduce_scatter_state_only_in_a_group_with_gradients() -> None:
    rs = Event("rs")
    ctx = NS(reduce_scatter_state=NS(event=rs))
    assert _rs_waits(group(ctx, [param()])) == [rs]
    assert _rs_waits(group(ctx, [param(grad=False, accumulated=True)])) == [rs]  # an accumulated gradient counts
    assert _rs_waits(group(ctx, [param(grad=False)])) == []  # FSDP2 returns before its wait
    assert _rs_waits(group(ctx, [param(unsharded=False)])) == []  # a parameter never unsharded has none
    assert _rs_waits(group(ctx, [param()], reduce_grads=False)) == []
    assert _rs_waits(group(NS(reduce_scatter_state=None), [param()])) == []


def test_a_group_s_own_earlier_reduction_is_waited_for_before_it_reduces_again() -> None:
    rs, own, ar = Event("rs"), Event("own"), Event("ar")
    g = group(NS(reduce_scatter_state=NS(event=rs)), [param()], post_reduce=own, all_reduce=NS(event=ar))
    assert _rs_waits(g) == [rs, own, ar]


def test_torch_2_13_waits_for_the_oldest_states_in_the_last_param_group_gradients_or_not() -> None:
    events = [Event(f"rs{i}") for i in range(3)]
    ctx = NS(reduce_scatter_states=[NS(event=e) for e in events], reduce_scatter_max_input_buffers=2)
    last = dict(_param_group_index=0, _num_param_groups=1)
    assert _rs_waits(group(ctx, [param()], **last)) == events[:2]  # pops until fewer than 2 remain
    assert _rs_waits(group(ctx, [param(grad=False)], **last)) == events[:2]
    assert _rs_waits(group(ctx, [param()], _param_group_index=0, _num_param_groups=2)) == []


def test_finalize_waits_for_the_group_s_reduction_every_stream_s_last_and_a_gather_never_waited_for() -> None:
    own, last, gather = Event("own"), Event("last"), Event("gather")
    work = object()
    g = group(NS(_last_post_reduce_events={"stream": last}), [param()], post_reduce=own,
              gathered=NS(all_gather_event=gather, all_gather_work=work))
    assert _finalize_waits(g) == ([own, last, gather], work)
    assert _finalize_waits(group(NS(), [param()])) == ([], None)


def test_a_wait_the_device_has_passed_gets_no_marks() -> None:
    done, pending = Event("done", done=True), Event("pending")
    assert _undone([done, pending]) == [pending]
    assert _undone([done]) == []


class Engine:
    def __init__(self, log: list) -> None:
        self.log, self.current = log, "forward"

    def switch(self, phase: str) -> None:
        self.log.append(("mark", phase))
        self.current = phase


def test_between_the_two_marks_only_the_stream_waits_for_each_event_then_the_group_s_work() -> None:
    """The stream is looked up before the first mark (its Python would sit in the span, which holds the host's time
    where the device keeps pace); a CPU group's work is waited for by the host, inside the span too."""
    log: list = []
    work = NS(wait=lambda: log.append(("work",)))
    stream = object()
    events = [Event("a", log=log), Event("b", log=log)]
    _between_marks(Engine(log), "forward", _wait_early, events, work, stream)
    assert log == [("mark", "forward.comm_wait"), ("wait", "a", stream), ("wait", "b", stream), ("work",),
                   ("mark", "forward")]


def test_events_that_are_not_cuda_s_wait_on_their_own_default_stream() -> None:
    assert _current_stream([Event("x")]) is None
    assert _current_stream([]) is None


def test_a_copy_out_s_wait_is_made_just_before_its_split_copy_after_its_python(monkeypatch) -> None:
    """FSDP2's copy-out gets its result without the event (so it does not wait at its start); the wait, between two
    marks, comes right before the split copy, its first kernel; what else is asked of the op is the op's."""
    from typing import NamedTuple

    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    from phase_timer.measures.comm.fsdp import FsdpComm

    class Result(NamedTuple):
        all_gather_output: object
        all_gather_event: object
        all_gather_work: object

    log: list = []

    class Op:
        default = "the op's overload"

        def __call__(self, *args, **kwargs):
            log.append(("split",))

    def copy_out(result, *args, **kwargs):
        log.append(("copy-out python", result.all_gather_event))
        torch.ops.fsdp.split_with_sizes_copy("out")

    monkeypatch.setattr(group_mod, "foreach_all_gather_copy_out", copy_out)
    monkeypatch.setattr(torch.ops.fsdp, "split_with_sizes_copy", Op())
    engine = Engine(log)
    FsdpComm._engines.append(engine)
    assert FsdpComm._wrap() is None
    try:
        group_mod.foreach_all_gather_copy_out(Result(None, Event("gather", log=log), None))
        assert log == [("copy-out python", None), ("mark", "forward.comm_wait"), ("wait", "gather", None),
                       ("mark", "forward"), ("split",)]
        assert torch.ops.fsdp.split_with_sizes_copy.default == "the op's overload"
        log.clear()  # an all-gather the device has passed: FSDP2 keeps its event, no marks
        done = Event("done", done=True, log=log)
        group_mod.foreach_all_gather_copy_out(Result(None, done, None))
        assert log == [("copy-out python", done), ("split",)]
    finally:
        FsdpComm._engines.remove(engine)
        FsdpComm._unwrap()
    assert group_mod.foreach_all_gather_copy_out is copy_out
    assert isinstance(torch.ops.fsdp.split_with_sizes_copy, Op)


def test_a_copy_out_that_never_reaches_its_split_copy_still_has_the_wait_made(monkeypatch) -> None:
    from typing import NamedTuple

    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    from phase_timer.measures.comm.fsdp import FsdpComm

    class Result(NamedTuple):
        all_gather_event: object
        all_gather_work: object

    log: list = []

    def copy_out(result, *args, **kwargs):
        raise RuntimeError("out of memory in the outputs' allocation")

    monkeypatch.setattr(group_mod, "foreach_all_gather_copy_out", copy_out)
    engine = Engine(log)
    FsdpComm._engines.append(engine)
    assert FsdpComm._wrap() is None
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            group_mod.foreach_all_gather_copy_out(Result(Event("gather", log=log), None))
        assert log == [("mark", "forward.comm_wait"), ("wait", "gather", None), ("mark", "forward")]
    finally:
        FsdpComm._engines.remove(engine)
        FsdpComm._unwrap()
    assert isinstance(torch.ops.fsdp.split_with_sizes_copy, torch._ops.OpOverloadPacket)  # FSDP2's own, put back
