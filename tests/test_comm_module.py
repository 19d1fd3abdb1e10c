"""The DDP split leaves the module as the user has it, in one process (gloo, world size 1): what it hooks, what it
reads, what two timers and a copy of the module see.  The timings themselves are test_comm.py's (2 ranks)."""

from __future__ import annotations

import copy
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phase_timer
from phase_timer.measures import comm
from phase_timer.measures.comm import ddp as comm_ddp
from phase_timer.measures.comm import run as comm_run
from phase_timer.measures.comm.copies import Copies

WAIT = "backward.comm_wait"


@pytest.fixture(scope="module", autouse=True)
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def ddp(**kw) -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(Net(), **kw)


def train(model, timer, opt, steps: int = 8, sync_forward: bool = True, sync_backward: bool = True) -> None:
    for _ in range(steps):
        x = torch.randn(4, 16)
        with (model.no_sync() if not sync_forward else torch.enable_grad()):
            loss = model(x).square().mean()
        with (model.no_sync() if not sync_backward else torch.enable_grad()):
            loss.backward()
        opt.step()
        opt.zero_grad()


def run(tmp_path, **kw) -> dict:
    model = ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, log_dir=str(tmp_path), warmup_steps=2, summary=False)
    train(model, timer, opt, **kw)
    return {p: t.mean for p, t in timer.close().phases.items()}


def test_the_parameter_heard_is_the_shallowest_and_its_hook_is_c(tmp_path) -> None:
    model = ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, log_dir=str(tmp_path), summary=False)
    probe = timer._comm[0]
    assert probe._param is model.module.head.weight  # not blocks.0.weight, the first but deeper
    if comm_ddp.Arm is not None:
        assert isinstance(probe._armed, comm_ddp.Arm)
    assert len(model.module.head.weight._post_accumulate_grad_hooks) == 1
    timer.close()
    assert not model.module.head.weight._post_accumulate_grad_hooks


def test_the_module_copies_and_pickles_while_timed_and_after(tmp_path) -> None:
    model = ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, log_dir=str(tmp_path), warmup_steps=1, summary=False)
    train(model, timer, opt, steps=3)
    ema = copy.deepcopy(model.module)  # an EMA copy, taken mid-run
    assert "register_comm_hook" not in vars(model)  # nothing of ours on the instance
    timer.close()
    assert comm_ddp._PROBES.get(model) is None
    assert nn.parallel.DistributedDataParallel.register_comm_hook is comm_ddp._DDP_OWN.get(
        "register_comm_hook", nn.parallel.DistributedDataParallel.register_comm_hook)
    assert not hasattr(nn.parallel.DistributedDataParallel.register_comm_hook, "__wrapped__")  # DDP's own again
    pickle.dumps(model.module)
    assert torch.equal(ema.head.weight, model.module.head.weight)


def test_the_sync_is_ddp_s_decision_at_forward(tmp_path) -> None:
    # forward under no_sync(), backward outside it: DDP does not all-reduce, so no wait is split
    assert WAIT not in run(tmp_path / "a", sync_forward=False)
    # forward outside, backward under no_sync(): DDP does all-reduce, and its wait is split
    assert WAIT in run(tmp_path / "b", sync_backward=False)
    assert WAIT in run(tmp_path / "c")


class Wide(nn.Module):
    """Gradients big enough that DDP's copies into .grad take milliseconds on a CPU (4 x 16 MB)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def copies_run(tmp_path, view: bool, steps: int, native: bool = True, monkeypatch=None, **ddp_kw) -> tuple:
    if not native:
        monkeypatch.setattr(comm_ddp, "Arm", None)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Wide(), gradient_as_bucket_view=view, **ddp_kw)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    timer = phase_timer.attach(model, opt, log_dir=str(tmp_path), warmup_steps=1, window=steps, summary=True)
    probe = timer._comm[0]
    assert (comm_ddp.Arm is not None and isinstance(probe._armed, comm_ddp.Arm)) == (native and comm_ddp.Arm is not None)
    for _ in range(steps):
        model(torch.randn(8, 2048)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # DDP copies into the .grad it finds
    run = comm_run.find(timer.core)
    totals = timer.close()
    return run, totals, timer


@pytest.mark.parametrize("native", [True, False])
def test_ddp_s_copies_into_grad_are_timed_on_sampled_backwards_and_taken_off_the_wait(tmp_path, native,
                                                                                     monkeypatch) -> None:
    run, totals, timer = copies_run(tmp_path, view=False, steps=7, native=native, monkeypatch=monkeypatch)
    # the 2nd, 3rd and 4th synced backwards were sampled (7 steps: no 1024th), each copy of the 8 parameters timed
    assert run.copy_samples == 3
    assert run.copy_ms is not None and run.copy_ms > 0
    assert torch._C._len_torch_dispatch_stack() == 0  # the mode was popped after each sampled end-of-backward
    # on a CPU the wait for a world of one is nil: what the span held is the copies, now backward's own
    wait, backward = totals.phases[WAIT].mean, totals.phases["backward"].mean
    # (quiet: what is left is 0.1-0.3 of the copies; not taken off, it would be more than all of them; another
    # process on the cores slows the copies of unsampled steps, not the sampled ones')
    assert wait < run.copy_ms, (wait, run.copy_ms)
    assert backward > run.copy_ms
    summary = timer.last_summary
    assert "are backward's and are taken off backward.comm_wait" in summary
    import json

    with open(timer.summary_path) as f:
        block = json.load(f)["communication"]
    assert block["copies_ms"] == pytest.approx(run.copy_ms) and block["copy_samples"] == 3
    assert block["collectives_ms"] is None and block["samples"] == 0


def test_under_find_unused_parameters_the_copies_stay_in_the_wait_and_the_table_says_why(tmp_path) -> None:
    """DDP waits for its used-parameter map's all-reduce among a bucket's copies (and reads it on the host): timed
    in place, that wait would be taken off as copies (a late peer's 80 ms read as 4 ms).  No copy is timed; the
    dispatch mode is never pushed."""
    run, totals, timer = copies_run(tmp_path, view=False, steps=7, find_unused_parameters=True)
    assert run.copy_ms is None and run.copy_samples == 0 and run.untimed_copies
    assert torch._C._len_torch_dispatch_stack() == 0
    assert "find_unused_parameters=True: its wait for the used-parameter map falls among them" in timer.last_summary


def test_without_copies_nothing_is_taken_off(tmp_path) -> None:
    run, totals, timer = copies_run(tmp_path, view=True, steps=6)
    assert run.copy_ms is None and run.copy_samples == 0  # gradient_as_bucket_view: DDP copies nothing
    assert torch._C._len_torch_dispatch_stack() == 0
    assert WAIT in totals.phases and "copies into .grad" not in timer.last_summary


def test_the_copy_is_taken_off_each_step_and_never_below_zero() -> None:
    run = comm.RunComm()
    from phase_timer.timing.clock import HostClock

    # two buckets' copies, each between its two marks: 1.5 + 2.5 ms (the wait between them is not theirs)
    run.add_copies(object(), [Copies(0, 1_500_000, 1_500_000, 1_500_000, False),
                              Copies(3_000_000, 5_500_000, 2_500_000, 2_500_000, False)], HostClock())
    columns = {WAIT: [1.0, 3.5, 10.0], "backward": [20.0, 21.0, 30.0]}
    sampled = {comm_run.COMM_MS: 12.0, comm_run.COMM_WAIT_MS: 8.0, comm_run.COMM_SAMPLES: 2.0}
    run.take_copies(columns, sampled)
    assert run.copy_ms == 4.0 and run.copy_samples == 1
    assert columns == {WAIT: [0.0, 0.0, 6.0], "backward": [20.0, 21.0, 30.0]}  # backward keeps them
    assert sampled[comm_run.COMM_WAIT_MS] == 0.0  # 8 - 2 samples x 4
    step = {WAIT: 5.0, "backward": 9.0}
    run.take_copy(step)
    assert step == {WAIT: 1.0, "backward": 9.0}
    step = {WAIT: 2.0, "backward": 9.0}
    run.take_copy(step)
    assert step == {WAIT: 0.0, "backward": 9.0}


def test_a_second_timer_keeps_the_split_when_the_first_closes(tmp_path) -> None:
    model = ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = phase_timer.attach(model, opt, log_dir=str(tmp_path / "1"), warmup_steps=1, summary=False)
    second = phase_timer.attach(model, opt, log_dir=str(tmp_path / "2"), warmup_steps=1, summary=False)
    first.close()
    train(model, second, opt, steps=6)
    assert WAIT in second.close().phases


@pytest.mark.skipif(comm_ddp.Arm is None, reason="the C extension is not built")
def test_the_c_hook_decides_as_the_python_one() -> None:
    class Engine:
        current = "backward"

    class Owner:
        flag = True

    queued: list = []
    engine, owner = Engine(), Owner()
    arm = comm_ddp.Arm(engine, "backward", owner, "flag", queued.append, "go")
    for current, flag in [("backward", True), ("forward", True), ("backward", False), (None, True)]:
        engine.current, owner.flag = current, flag
        queued.clear()
        assert arm(torch.zeros(1)) is None
        assert queued == (["go"] if (current, flag) == ("backward", True) else [])
    sampled = comm_ddp.Arm(engine, "backward", owner, "flag", queued.append, "go", "sample")
    assert sampled.due == 0
    engine.current, sampled.due = "backward", 2
    owner.flag = False  # a backward that does not sync is not counted
    sampled(1)
    owner.flag = True
    queued.clear()
    for _ in range(4):
        sampled(1)
    assert queued == ["go", "sample", "go", "go"] and sampled.due == 0  # the 2nd counted; 0 stays 0
    owner.flag, engine.current, queued = True, "backward", None  # queue raises: no split, and no error in backward
    arm2 = comm_ddp.Arm(engine, "backward", owner, "missing", queued, "go")
    assert arm2(torch.zeros(1)) is None and comm_ddp.Arm(engine, "backward", owner, "flag", None, "go")(1) is None
    queued = []
    arm3 = comm_ddp.Arm(engine, "backward", owner, "flag", queued.append, "go")
    assert arm3.callback == "go"
    arm3.callback = "paced"  # set anew between backwards (a host-paced module's start)
    arm3(1)
    assert queued == ["paced"]
    with pytest.raises(AttributeError):
        del arm3.callback


def test_copies_paced_by_the_mode_s_python_are_read_at_the_pace_of_their_own_launches() -> None:
    """A bucket's copies on a sampled backward: where the device caught up with the host, the marks hold the mode's
    Python between the copies (200 small copies: 4.25 ms apart on the device, 4.3 on the host, 0.8 ms of which in
    the copies' own calls); that Python is taken off.  Where the device had not reached the first mark (every copy
    queued), or the marks are further apart on the device than on the host, the marks hold the copies' own time."""
    from phase_timer.timing.clock import HostClock

    clock = HostClock()
    ms = 1_000_000
    paced = Copies(0, int(4.25 * ms), int(4.3 * ms), int(0.8 * ms), True)
    assert paced.ms(clock) == pytest.approx(0.8)  # 4.25 - (4.3 - 0.8) = 0.75, never below the calls' own 0.8
    part = Copies(0, int(2.0 * ms), int(2.2 * ms), int(0.5 * ms), True)
    assert part.ms(clock) == pytest.approx(0.5)  # max(0.5, 2.0 - 1.7)
    queued = Copies(0, int(4.25 * ms), int(4.3 * ms), int(0.8 * ms), False)
    assert queued.ms(clock) == pytest.approx(4.25)
    slow = Copies(0, int(0.07 * ms), int(0.025 * ms), int(0.005 * ms), True)  # one 100 MB copy: the device's time
    assert slow.ms(clock) == pytest.approx(0.07)
    tiny = Copies(0, int(0.01 * ms), int(0.5 * ms), int(0.4 * ms), True)  # never above the marks' own span
    assert tiny.ms(clock) == pytest.approx(0.01)
    run = comm.RunComm()
    run.add_copies(object(), [paced, queued], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.8 + 4.25)


def test_a_bucket_caught_up_by_the_device_takes_its_queued_samples() -> None:
    """Each bucket's estimate is its own: where the device caught up with the host among a bucket's copies on one
    sample (the mode's pace, read at best as the copies' own calls' host time), the same bucket's samples whose
    copies were all queued (their time back to back) stand for it; a bucket with none keeps its caught ones."""
    from phase_timer.timing.clock import HostClock

    clock, ms = HostClock(), 1_000_000
    queued = Copies(0, int(0.1 * ms), int(0.55 * ms), int(0.3 * ms), False)  # 22 copies queued: 0.1 ms on the device
    paced = Copies(0, int(0.52 * ms), int(0.52 * ms), int(0.29 * ms), True)  # caught up: read as 0.29 at best
    run, probe = comm.RunComm(), object()
    run.add_copies(probe, [queued, paced], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.1 + 0.29)  # bucket 2 has no queued sample yet
    run.add_copies(probe, [paced, queued], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.1 + 0.1) and run.copy_samples == 2  # each bucket's queued sample
    run.add_copies(probe, [queued, queued, queued], clock)  # DDP rebuilt its buckets: three now
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.3)
    run.add_copies(object(), [paced], clock)  # a second module: its own buckets, summed with the first's
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.3 + 0.29)


def test_both_engines_take_a_negative_host_value_off_the_wait_alone() -> None:
    """``add_host(WAIT, -ms)`` on the open record: summed into the wait's own row by both engines, not into
    ``backward``'s (its parent sums spans only), so the phases still add up."""
    from phase_timer.timing.clock import HostClock
    from phase_timer.timing.engine import PyEngine, Steps, native_steps

    def ticks():
        t = iter(range(0, 10**12, 1_000_000))  # 1 ms a mark
        return lambda: next(t)

    class Ticking(HostClock):
        def __init__(self) -> None:
            self._next = ticks()

        def mark(self) -> int:
            return self._next()

    engines = [PyEngine(Ticking(), window=1, max_pending=8, lag=0, per_step=True)]
    if Steps is not None:
        engines.append(native_steps(ticks(), 1, 8, 0, per_step=True))
    for engine in engines:
        engine.open(0, "forward")
        for phase in ("backward", WAIT, "backward", "optimizer"):
            engine.switch(phase)
            if phase == WAIT:
                engine.add_host(WAIT, -0.4)
        engine.close(-1.0)
        (step,) = [r[2] for r in engine.drain() if r[0] == "step"]
        assert step[WAIT] == pytest.approx(0.6) and step["backward"] == pytest.approx(3.0)
        assert step["forward"] + step["backward"] + step["optimizer"] == pytest.approx(step["step"])


def test_a_wait_below_zero_never_reaches_a_window_or_a_step_line() -> None:
    """A host-paced step's correction may take more than its span (the device still behind at the span's start):
    the window's and the step's wait stop at zero with or without a copies' estimate; sorted stays sorted."""
    run = comm.RunComm()
    columns = {WAIT: [-0.3, 0.0, 0.2], "backward": [5.0, 6.0, 7.0]}
    run.take_copies(columns, {})
    assert columns == {WAIT: [0.0, 0.0, 0.2], "backward": [5.0, 6.0, 7.0]}
    step = {WAIT: -0.1, "backward": 5.0}
    run.take_copy(step)
    assert step == {WAIT: 0.0, "backward": 5.0}
    step = {WAIT: 0.3}
    run.take_copy(step)
    assert step == {WAIT: 0.3}
