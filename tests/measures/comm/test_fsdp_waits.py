"""Which FSDP2 waits phase-timer makes early between marks, as each torch's FSDP2 decides them (torch 2.11's one
reduce-scatter state, torch 2.13's list), on stand-ins for FSDP2's objects: the real ones need two processes
(``tests/measures/comm/test_comm.py`` runs them on gloo) and the real waits two GPUs (``benchmarks/comm_nccl.py``)."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import NamedTuple

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


class Result(NamedTuple):
    all_gather_output: object
    all_gather_event: object
    all_gather_work: object


class Op:
    """A stand-in for ``torch.ops.fsdp.split_with_sizes_copy``."""

    default = "the op's overload"

    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, *args, **kwargs) -> None:
        self.log.append(("split",))


@pytest.fixture
def wrapped(monkeypatch):
    """FSDP2's copy-out and split copy replaced by stand-ins that log, then wrapped by phase-timer; yields the log and a
    setter for the copy-out's body; put back after."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    from phase_timer.measures.comm import fsdp
    from phase_timer.measures.comm.fsdp import FsdpComm

    log: list = []
    body = {"fn": lambda result: torch.ops.fsdp.split_with_sizes_copy("out")}

    def copy_out(result, *args, **kwargs):
        log.append(("copy-out python", result.all_gather_event))
        return body["fn"](result)

    op = Op(log)
    monkeypatch.setattr(group_mod, "foreach_all_gather_copy_out", copy_out)
    monkeypatch.setattr(torch.ops.fsdp, "split_with_sizes_copy", op)
    stream = object()
    monkeypatch.setattr(fsdp, "_defers", lambda fn: fn is copy_out)  # the stand-in, taken for torch's own
    monkeypatch.setattr(fsdp, "_current_stream", lambda events: log.append(("stream lookup",)) or stream)
    engine = Engine(log)
    FsdpComm._engines.append(engine)
    assert FsdpComm._wrap() is None
    try:
        yield NS(log=log, body=body, stream=stream, call=group_mod.foreach_all_gather_copy_out)
    finally:
        FsdpComm._engines.remove(engine)
        FsdpComm._unwrap()
    assert group_mod.foreach_all_gather_copy_out is copy_out  # FSDP2's own (here the stand-ins) put back
    assert torch.ops.fsdp.split_with_sizes_copy is op


def test_a_copy_out_s_wait_is_made_just_before_its_split_copy_after_its_python(wrapped) -> None:
    """FSDP2's copy-out gets its result without the event (so it does not wait at its start); the wait, between two
    marks, comes right before the split copy, its first kernel, on the stream looked up before the first mark; what
    else is asked of the op is the op's."""
    import torch

    w = wrapped
    w.call(Result(None, Event("gather", log=w.log), None))
    assert w.log == [("stream lookup",), ("copy-out python", None), ("mark", "forward.comm_wait"),
                     ("wait", "gather", w.stream), ("mark", "forward"), ("split",)]
    assert torch.ops.fsdp.split_with_sizes_copy.default == "the op's overload"
    w.log.clear()  # an all-gather the device has passed: FSDP2 keeps its event, no marks
    done = Event("done", done=True, log=w.log)
    w.call(Result(None, done, None))
    assert w.log == [("copy-out python", done), ("split",)]


def test_a_copy_out_that_never_reaches_its_split_copy_still_has_the_wait_made(wrapped) -> None:
    w = wrapped

    def raises(result):
        raise RuntimeError("out of memory in the outputs' allocation")

    w.body["fn"] = raises
    with pytest.raises(RuntimeError, match="out of memory"):
        w.call(Result(None, Event("gather", log=w.log), None))
    assert w.log == [("stream lookup",), ("copy-out python", None), ("mark", "forward.comm_wait"),
                     ("wait", "gather", w.stream), ("mark", "forward")]


def test_a_copy_out_that_raises_after_its_split_copy_waits_once(wrapped) -> None:
    import torch

    w = wrapped

    def split_then_raise(result):
        torch.ops.fsdp.split_with_sizes_copy("out")
        raise RuntimeError("after the split")

    w.body["fn"] = split_then_raise
    with pytest.raises(RuntimeError, match="after the split"):
        w.call(Result(None, Event("gather", log=w.log), None))
    assert [e for e in w.log if e[0] == "wait"] == [("wait", "gather", w.stream)]
    assert w.log.index(("wait", "gather", w.stream)) < w.log.index(("split",))


def test_an_async_group_s_work_is_waited_for_at_the_copy_out_s_start(wrapped) -> None:
    """With a Work (an async group), FSDP2 keeps its event and the early wait is made, as before the split existed."""
    w = wrapped
    work = NS(wait=lambda: w.log.append(("work",)))
    gather = Event("gather", log=w.log)
    w.call(Result(None, gather, work))
    assert w.log == [("stream lookup",), ("mark", "forward.comm_wait"), ("wait", "gather", w.stream), ("work",),
                     ("mark", "forward"), ("copy-out python", gather), ("split",)]


def test_only_torch_s_own_copy_out_leaves_its_wait_to_the_split_copy() -> None:
    """torch's copy-out calls ``torch.ops.fsdp.split_with_sizes_copy`` by name (a torch whose copy-out stops would keep
    its wait at the start); someone else's copy-out (a fork's, which may cast the output first) keeps it there."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    from phase_timer.measures.comm.fsdp import _defers

    assert _defers(group_mod.foreach_all_gather_copy_out)

    def theirs(result, *args, **kwargs):
        import torch

        torch.ops.fsdp.split_with_sizes_copy(result)

    assert not _defers(theirs)  # not torch's module
    torch_s = group_mod.foreach_all_gather_copy_out.__module__
    theirs.__module__ = torch_s
    assert _defers(theirs)  # in torch's module, its source calling the op by name

    def casts_first(result, *args, **kwargs):
        return result.all_gather_output.float()

    casts_first.__module__ = torch_s
    assert not _defers(casts_first)  # in torch's module, no split copy by name
    ns: dict = {}
    exec("def no_source(result):\n    return result\n", ns)  # noqa: S102 - a function with no file to read
    ns["no_source"].__module__ = torch_s
    assert not _defers(ns["no_source"])


def test_a_copy_out_that_returns_without_its_split_copy_waits_warns_once_and_then_waits_at_its_start(wrapped) -> None:
    import warnings

    w = wrapped
    w.body["fn"] = lambda result: None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.call(Result(None, Event("first", log=w.log), None))
        second = Event("second", log=w.log)
        w.call(Result(None, second, None))
    assert sum("without its split copy" in str(c.message) for c in caught) == 1
    assert w.log == [("stream lookup",), ("copy-out python", None), ("mark", "forward.comm_wait"),
                     ("wait", "first", w.stream), ("mark", "forward"),
                     ("stream lookup",), ("mark", "forward.comm_wait"), ("wait", "second", w.stream),
                     ("mark", "forward"), ("copy-out python", second)]


def test_a_split_copy_on_another_thread_leaves_this_thread_s_pending_wait_alone() -> None:
    """Forward's copy-outs run on the loop's thread, backward's on autograd's: each thread's split copy makes its own
    thread's wait only."""
    import threading

    from phase_timer.measures.comm.fsdp import _SplitCopy

    log: list = []
    late = {threading.get_ident(): (Engine(log), "forward", [Event("mine", log=log)], None)}
    split = _SplitCopy(Op(log), late)
    other = threading.Thread(target=split)
    other.start()
    other.join()
    assert log == [("split",)] and threading.get_ident() in late
    split()
    assert log == [("split",), ("mark", "forward.comm_wait"), ("wait", "mine", None), ("mark", "forward"), ("split",)]
    assert not late
