"""The DDP split leaves the module as the user has it, in one process (gloo, world size 1): what it hooks, what it
reads, what two timers and a copy of the module see.  The timings themselves are test_comm.py's (2 ranks)."""

from __future__ import annotations

import copy
import pickle
import socket
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phase_timer
from phase_timer.measures import comm
from phase_timer.measures.comm import ddp as comm_ddp
from phase_timer.measures.comm import paced as comm_paced
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


def test_under_find_unused_parameters_with_every_parameter_used_the_copies_are_timed(tmp_path) -> None:
    """DDP reads no used-parameter map where every parameter got a gradient on the rank (the 🤗 Trainer's default
    runs with find_unused_parameters=True): the copies are timed and taken off as under DDP's defaults."""
    run, totals, timer = copies_run(tmp_path, view=False, steps=7, find_unused_parameters=True)
    assert run.copy_samples == 3 and run.copy_ms is not None and run.copy_ms > 0 and not run.untimed_copies
    assert torch._C._len_torch_dispatch_stack() == 0
    assert "are backward's and are taken off backward.comm_wait" in timer.last_summary


class WideSkip(Wide):
    """Wide with a layer that gets no gradient: DDP (find_unused_parameters) reads its used-parameter map."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = nn.Sequential(nn.Linear(2048, 2048))  # as deep as the blocks: not the parameter heard


def test_a_parameter_without_a_gradient_leaves_the_copies_in_the_wait_and_the_table_says_why(tmp_path,
                                                                                          monkeypatch) -> None:
    """Where a parameter gets no gradient, DDP waits for its used-parameter map's all-reduce among a bucket's copies
    and copies the map to the host: timed in place, that wait would be taken off as copies (a late peer's 80 ms read
    as 4 ms).  The first sampled backward sees the map's copy: nothing is read, the copies are not timed from then
    on (no mode pushed again), and the table says why."""
    pushed = []
    real = comm_ddp._push_mode
    monkeypatch.setattr(comm_ddp, "_push_mode", lambda mode: (pushed.append(mode), real(mode)))
    monkeypatch.setattr(sys.modules[__name__], "Wide", WideSkip)
    run, totals, timer = copies_run(tmp_path, view=False, steps=7, find_unused_parameters=True)
    assert len(pushed) == 1 and pushed[0].synced  # the counting backward (the 2nd synced) saw the map; no more
    assert run.copy_ms is None and run.copy_samples == 0 and run.untimed_copies
    assert torch._C._len_torch_dispatch_stack() == 0
    assert "DDP's wait for its used-parameter map falls among them, so they are not timed" in timer.last_summary


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


def test_a_step_that_waited_loses_each_bucket_s_quickest_sample() -> None:
    """A bucket's copies run ~1.5x slower beside collectives that move data than beside collectives waiting for a
    late peer (2 x H200: 0.065 or 0.045 ms for 12 copies): a step whose span exceeds the copies' median estimate by
    more than ``WAITED_MS`` waited, and loses each bucket's quickest sample; one within it loses the median."""
    from phase_timer.timing.clock import HostClock

    run, probe, ms = comm.RunComm(), object(), 1_000_000
    for slow, quick in ((0.065, 0.05), (0.045, 0.08), (0.07, 0.09)):  # two buckets, three samples each
        run.add_copies(probe, [Copies(0, int(slow * ms), int(slow * ms), int(slow * ms), False),
                               Copies(0, int(quick * ms), int(quick * ms), int(quick * ms), False)], HostClock())
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.065 + 0.08) and run.copy_low_ms == pytest.approx(0.045 + 0.05)
    median, low = run.copy_ms, run.copy_low_ms
    just = median + comm_run.WAITED_MS
    columns = {WAIT: [0.1, just, just + 0.001, 5.0], "backward": [9.0] * 4}
    run.take_copies(columns, {})
    assert columns[WAIT] == pytest.approx([0.0, just - median, just + 0.001 - low, 5.0 - low])
    assert columns[WAIT] == sorted(columns[WAIT])  # the window's values stay sorted
    step = {WAIT: 5.0}
    run.take_copy(step)
    assert step[WAIT] == pytest.approx(5.0 - low)
    step = {WAIT: 0.2}
    run.take_copy(step)
    assert step[WAIT] == pytest.approx(0.2 - median)
    assert run.summary()["copies_waited_ms"] == pytest.approx(low)
    assert (f"{low:.3f} ms, each bucket's quickest sample, on a step whose span exceeds {median:.3f} by more than "
            f"{comm_run.WAITED_MS} ms") in comm_run.copy_note(run)
    assert comm_run.less_copies(-0.4, median, low) == 0.0  # a host-paced correction past the span: never below 0
    second = object()  # a second module: both estimates summed over the modules, each forgotten with its own
    run.add_copies(second, [Copies(0, int(0.03 * ms), int(0.03 * ms), int(0.03 * ms), False)], HostClock())
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(median + 0.03) and run.copy_low_ms == pytest.approx(low + 0.03)
    run.forget_copies(probe)
    assert run.copy_ms == pytest.approx(0.03) and run.copy_low_ms == pytest.approx(0.03)
    run.forget_copies(second)
    assert run.copy_ms is None and run.copy_low_ms is None


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


class DeviceKindClock:
    """The host clock's arithmetic under a device's kind: samples read as a device's (caught up or queued)."""

    kind = "cuda"

    def __init__(self) -> None:
        from phase_timer.timing.clock import HostClock

        self._host = HostClock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


def test_copies_paced_by_the_mode_s_python_are_read_at_the_pace_of_their_own_launches() -> None:
    """A bucket's copies on a sampled backward: where the device caught up with the host, the marks hold the mode's
    Python between the copies (200 small copies: 4.25 ms apart on the device, 4.3 on the host, 0.8 ms of which in
    the copies' own calls); that Python is taken off, and what is left is the pace of DDP's launches, not the copies'
    own time: the estimate takes no such sample.  Where the device had not reached the first mark (every copy
    queued), or the marks are further apart on the device than on the host, the marks hold the copies' own time.
    On the host clock the copies run as the host makes them: every sample is their own time."""
    from phase_timer.timing.clock import HostClock

    clock = DeviceKindClock()
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
    assert run.copy_ms == pytest.approx(4.25) and run.copy_unqueued == 1  # the caught-up bucket adds nothing
    assert "; 1 bucket's copies ran at the pace of DDP's launches" in comm_run.copy_note(run)
    assert run.summary()["copies_unqueued"] == 1
    run = comm.RunComm()
    run.add_copies(object(), [slow, paced], clock)  # caught up, but slower than its launches: its own time
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.07) and run.copy_unqueued == 1
    run = comm.RunComm()
    run.add_copies(object(), [paced, part], clock)  # every bucket caught up: nothing known, nothing taken
    run.resolve_copies()
    assert run.copy_ms == 0.0 and isinstance(run.copy_ms, float) and run.copy_unqueued == 2
    note = comm_run.copy_note(run)
    assert note.startswith("DDP's copies into .grad, sampled on 1 backwards: 2 buckets' copies ran at the pace")
    assert "taken off" not in note
    run = comm.RunComm()
    run.add_copies(object(), [paced, queued], HostClock())
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.8 + 4.25) and run.copy_unqueued == 0


def test_a_bucket_caught_up_by_the_device_takes_its_queued_samples() -> None:
    """Each bucket's estimate is its own: where the device caught up with the host among a bucket's copies on one
    sample (the pace of DDP's launches, 3-5x the copies' own time on 2 x H200), the same bucket's samples whose
    copies were all queued (their time back to back) stand for it; a bucket with none adds nothing yet (a
    host-paced step loses its span's host time whole, the copies' pace in it: ``paced.PacedSpans``)."""
    clock, ms = DeviceKindClock(), 1_000_000
    queued = Copies(0, int(0.1 * ms), int(0.55 * ms), int(0.3 * ms), False)  # 22 copies queued: 0.1 ms on the device
    paced = Copies(0, int(0.52 * ms), int(0.52 * ms), int(0.29 * ms), True)  # caught up: read as 0.29 at best
    run, probe = comm.RunComm(), object()
    run.add_copies(probe, [queued, paced], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.1) and run.copy_unqueued == 1  # bucket 2 has no queued sample yet
    run.add_copies(probe, [paced, queued], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.1 + 0.1) and run.copy_samples == 2  # each bucket's queued sample
    assert run.copy_unqueued == 0
    run.add_copies(probe, [queued, queued, queued], clock)  # DDP rebuilt its buckets: three now
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.3)
    second = object()
    run.add_copies(second, [paced], clock)  # a second module: its own buckets, summed with the first's
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.3) and run.copy_unqueued == 1
    run.add_copies(second, [queued], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.3 + 0.1) and run.copy_unqueued == 0



def test_a_module_whose_copies_turn_untimed_takes_its_estimate_and_its_pending_samples_along() -> None:
    """DDP read its used-parameter map on a module's sampled backward (a parameter unused on this rank): its
    estimate goes, and so do its samples not resolved yet (their marks released); another module's stays."""
    from phase_timer.timing.clock import HostClock

    clock, ms = HostClock(), 1_000_000
    queued = Copies(0, int(0.1 * ms), int(0.55 * ms), int(0.3 * ms), False)
    run, first, second = comm.RunComm(), object(), object()
    run.add_copies(first, [queued], clock)
    run.add_copies(second, [queued, queued], clock)
    run.resolve_copies()
    assert run.copy_ms == pytest.approx(0.3)
    assert run.copy_samples == 2
    run.add_copies(first, [queued], clock)  # pending: not resolved before the map was seen
    run.forget_copies(first)
    assert run.copy_ms == pytest.approx(0.2) and run.module_copy_ms(first) == 0.0 and not run._copy_pending
    assert run.copy_samples == 1  # the second module's: what the table's count says is timed
    run.forget_copies(second)
    assert run.copy_ms is None and run.copy_samples == 0


# -- the host-paced span (issue 47): the device idles in it for DDP's launches ---------------------------------

class PacedEngine:
    """An engine's calls as the split makes them, on a device whose answer to ``behind()`` the test sets (None: the
    host clock)."""

    def __init__(self) -> None:
        self.current: str | None = "backward"
        self.behind_is: bool | None = False
        self.calls: list[tuple] = []

    def switch(self, phase: str) -> None:
        if phase != self.current:
            self.calls.append(("switch", phase))
        self.current = phase

    def behind(self) -> bool | None:
        self.calls.append(("behind",))
        return self.behind_is

    def add_host(self, phase: str, ms: float) -> None:
        self.calls.append(("add_host", phase, ms))


class PacedClock:
    """A device clock whose marks the test says are done or not (``done_is``: the span's end passed by the next
    optimizer step), and which counts the marks not yet released."""

    def __init__(self, kind: str) -> None:
        self.kind, self.done_is, self.live, self.asked = kind, True, set(), 0
        self._n = 0

    def mark(self) -> int:
        self._n += 1
        self.live.add(self._n)
        return self._n

    def done(self, mark: int) -> bool:
        self.asked += 1
        return self.done_is

    def release(self, marks: list) -> None:
        self.live.difference_update(marks)


class PacedCore:
    def __init__(self, engine: PacedEngine, kind: str = "cuda") -> None:
        self._engine, self.clock = engine, PacedClock(kind)
        self.run = comm.RunComm()
        self.measures = [self.run]


class HostNs:
    """perf_counter_ns as the test sets it: ``at`` ms."""

    def __init__(self) -> None:
        self.at = 0.0

    def perf_counter_ns(self) -> int:
        return int(self.at * 1_000_000)


class SampledCopies:
    """What the dispatch mode hands over after a sampled end-of-backward: two buckets' copies, timed; whether the
    device had caught up with the host at the last bucket's is the test's."""

    def __init__(self, kept_up: bool) -> None:
        from phase_timer.timing.clock import HostClock

        self._pairs = [Copies(0, 1000, 1000, 1000, True), Copies(0, 1000, 1000, 1000, kept_up)]
        self.marks, self.clock, self.counts, self.passthrough = [], HostClock(), [1, 1], False
        self.synced = False  # DDP read no used-parameter map among them

    def pairs(self) -> list:
        return self._pairs


def paced_probe(monkeypatch, native: bool = True, kind: str = "cuda", copies_ms: float | None = None,
                **ddp_kw) -> tuple:
    """A split bound to a fake engine and clock; the parameter's hook and autograd's final callbacks run by hand."""
    from types import SimpleNamespace

    from phase_timer.timing.clock import HostClock

    if not native:
        monkeypatch.setattr(comm_ddp, "Arm", None)
    ns = HostNs()
    monkeypatch.setattr(comm_ddp, "time", ns)
    monkeypatch.setattr(comm_paced, "time", ns)  # the host-paced path's clock
    engine = PacedEngine()
    core = PacedCore(engine, kind)
    module = SimpleNamespace(**{"gradient_as_bucket_view": False, "find_unused_parameters": False, **ddp_kw,
                                comm_ddp.SYNCED: True})
    param = torch.zeros(1, requires_grad=True)
    probe = comm_ddp.DdpComm(module, param)
    queued: list = []
    probe._queue_callback = queued.append
    probe.bind(core)
    probe._schedule(0)  # the copies sampled where the test says
    if copies_ms is not None:
        ms = int(copies_ms * 1_000_000)
        core.run.add_copies(probe, [Copies(0, ms, ms, ms, False)], HostClock())
        core.run.resolve_copies()

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    def backward(host_ms: float, python: bool = False, kept_up: bool | None = None, step: bool = True,
                 gap_ms: float = 0.0) -> list[tuple]:
        """One synced backward whose span the host spends ``host_ms`` in: the parameter's hook (``python``: a span
        begun in Python, a composed hook's; ``kept_up``: a sampled one, its copies timed), then the final callbacks
        in autograd's order (DDP's end-of-backward, queued before ours ran, is between our start and our end); then
        (``step``) a real optimizer step, whose global pre-hooks run before the door's switch."""
        engine.calls.clear()
        engine.current = "backward"
        if python or kept_up is not None:
            queued.append(probe._split)
        else:
            probe._armed(param)
        while queued:
            callback = queued.pop(0)
            callback()
            if callback == probe._split and kept_up is not None:
                probe._copies = SampledCopies(kept_up)  # the mode pushed for DDP's end-of-backward
            ns.at += host_ms  # DDP's end-of-backward: its waits and copies, launched
        ns.at -= host_ms  # the host reaches the optimizer step right after the span (the loop above added one more)
        ns.at += gap_ms  # ... or this long after it (a sync before the step, the loop's own work)
        if step:
            opt.step()  # torch's global optimizer pre-hooks first, then the door's: its switch
            engine.switch("optimizer")
        probe._schedule(0)  # the next sample where the test says
        return [c for c in engine.calls if c[0] != "behind"]

    backward.clock = core.clock
    return probe, engine, backward


def start_queued(probe) -> Any:
    native = comm_ddp.Arm is not None and isinstance(probe._armed, comm_ddp.Arm)
    return probe._armed.callback if native else probe._start


PACED = [("switch", WAIT), ("switch", "backward")]  # a span ended in Python, after DDP's end-of-backward


@pytest.mark.parametrize("native", [True, False])
def test_the_paced_path_asks_from_the_first_backward_until_the_device_is_behind(monkeypatch, native) -> None:
    """On a device the span's start is the Python one from the first synced backward (its host time noted, both
    questions asked); PACED_OFF answers "behind" in a row turn it into the engine's own switch, and a sample whose
    last bucket's copies the device caught up with turns it back.  A sample whose copies all queued (the device
    still in a wait when the host had launched them: a rank waiting for its peers) takes nothing and turns nothing."""
    probe, engine, backward = paced_probe(monkeypatch, native)
    assert probe._paced and start_queued(probe) == probe._paced_start
    assert backward(2.5) == [*PACED, ("add_host", WAIT, -2.5), ("switch", "optimizer")]
    assert backward(2.0, kept_up=False) == [*PACED, ("switch", "optimizer")] and probe._paced
    assert (probe.paced_steps, probe.paced_ms) == (1, 2.5)
    # a device behind the host (it had not begun the span): nothing taken; PACED_OFF such backwards in a row: off
    engine.behind_is = True
    for _ in range(comm_paced.PACED_OFF - 1):
        assert backward(2.0) == [*PACED, ("switch", "optimizer")]
    assert probe._paced
    engine.behind_is = False
    backward(2.0)  # caught up again: the count starts anew
    engine.behind_is = True
    for _ in range(comm_paced.PACED_OFF):
        backward(2.0)
    assert not probe._paced and start_queued(probe) is probe._to_wait
    assert backward(2.0) == [("switch", WAIT), ("switch", "optimizer")]
    # off: a span ended in Python with no sample of the copies asks nothing; a queued sample turns nothing
    engine.behind_is = False
    assert backward(2.5, python=True) == [*PACED, ("switch", "optimizer")] and not probe._paced
    assert backward(2.5, kept_up=False) == [*PACED, ("switch", "optimizer")] and not probe._paced
    # a sampled backward whose device had caught up with the host at its last bucket's copies: on, 2.5 ms taken
    assert backward(2.5, kept_up=True) == [*PACED, ("add_host", WAIT, -2.5), ("switch", "optimizer")]
    assert probe._paced and start_queued(probe) == probe._paced_start
    assert backward(1.25) == [*PACED, ("add_host", WAIT, -1.25), ("switch", "optimizer")]
    assert probe.paced_steps == 4
    probe.bind(None)


@pytest.mark.parametrize("native", [True, False])
def test_a_steadily_host_paced_module_asks_every_backward_and_keeps_a_wait_after_a_long_steady_run(
        monkeypatch, native) -> None:
    """However many host-paced backwards in a row kept pace, the next one is asked too (one query at the span's end,
    one mark queried at the optimizer step): a peer late once after a long steady run (its device still in the span
    at the optimizer step) keeps its wait whole, and the one after it is taken again."""
    probe, engine, backward = paced_probe(monkeypatch, native, copies_ms=0.5)
    clock = backward.clock
    for i in range(64):
        asked, marks = clock.asked, clock._n
        assert backward(2.5) == [*PACED, ("add_host", WAIT, pytest.approx(-2.0)), ("switch", "optimizer")]
        assert ("behind",) in engine.calls and clock._n == marks + 1 and clock.asked == asked + 1, i
        assert start_queued(probe) == probe._paced_start
    clock.done_is = False  # a peer late once: the device still waits in the span at the optimizer step
    assert backward(2.5) == [*PACED, ("switch", "optimizer")] and probe.paced_waiting == 1
    clock.done_is = True
    assert backward(2.5) == [*PACED, ("add_host", WAIT, pytest.approx(-2.0)), ("switch", "optimizer")]
    assert probe.paced_steps == 65 and not clock.live
    probe.bind(None)


def test_a_composed_hook_s_module_asks_every_host_paced_backward(monkeypatch) -> None:
    """A module with the user's comm hook composed begins every span in Python (``_split``): each host-paced backward
    is asked (its mark queried at the optimizer step) and its host time taken, however many kept pace in a row."""
    probe, engine, backward = paced_probe(monkeypatch)
    probe._inner = lambda state, bucket: None  # composed: _began queues _split
    clock = backward.clock
    for i in range(40):
        asked = clock.asked
        assert backward(2.5, python=True) == [*PACED, ("add_host", WAIT, -2.5), ("switch", "optimizer")]
        assert clock.asked == asked + 1, i
    assert probe.paced_steps == 40 and not clock.live
    probe.bind(None)


def test_a_waiting_span_has_the_copies_sampled_where_a_bucket_has_no_queued_sample(monkeypatch) -> None:
    """A host-paced span kept whole because its device still waited in it at the optimizer step (a rank waiting for
    its peer), or one whose device was behind its host at the span's end, on a module with a bucket whose copies no
    sample saw queued (sampled while host-paced): the next synced backward's copies are timed (they queue), at most
    RESAMPLE times a binding.  Not where every bucket has a queued sample, nor where the span was taken, nor where
    the host reached the step late, nor while a sample of the module is still to resolve."""
    from collections import deque

    probe, engine, backward = paced_probe(monkeypatch, copies_ms=0.5)
    clock = backward.clock
    asked: list[int] = []
    schedule = probe._schedule
    monkeypatch.setattr(probe, "_schedule", lambda due: (asked.append(due), schedule(due)))

    def sampled(**kw) -> bool:
        asked.clear()
        backward(2.5, **kw)
        return 1 in asked[:-1]  # the harness schedules 0 last

    clock.done_is = False
    assert not sampled()  # waiting, every bucket queued: nothing to learn
    probe._run._copy_buckets[id(probe)].append((deque(maxlen=3), deque([0.3], maxlen=3)))  # caught up only
    assert probe._run.unqueued(probe)
    clock.done_is = True
    assert not sampled()  # taken: the device kept pace
    waiting = probe.paced_waiting
    assert not sampled(gap_ms=4.0) and probe.paced_waiting == waiting + 1  # kept whole (the host late), device done
    clock.done_is = False
    assert [sampled() for _ in range(comm_ddp.RESAMPLE + 2)] == [True] * comm_ddp.RESAMPLE + [False, False]
    probe._resamples = comm_ddp.RESAMPLE
    clock.done_is = True
    engine.behind_is = True  # a device behind its host at the span's end: its copies queued too
    assert sampled()
    probe._run._copy_pending.append((id(probe), [], clock))  # a sample still to resolve: it may bring the bucket in
    assert not sampled()
    probe._run._copy_pending.clear()
    schedule(1)  # a sample already due next: none asked for, none of the allowance spent
    resamples = probe._resamples
    probe._resample()
    assert probe._resamples == resamples
    schedule(0)
    engine.behind_is, clock.done_is = False, False
    probe.bind(probe._core)  # a new binding: RESAMPLE again
    schedule(0)  # its own first samples (COPY_LEARN) where the test says
    probe._run._copy_buckets[id(probe)] = [(deque(maxlen=3), deque([0.3], maxlen=3))]
    assert sampled()
    probe.bind(None)


def test_a_host_that_reaches_the_optimizer_step_late_tells_nothing_and_keeps_the_wait(monkeypatch) -> None:
    """The second question's "done" says the device kept pace only where the host reached the step promptly: a
    host that took longer after the span than its own time in it (a sync before the step: ``GradScaler.step``'s
    inf check, a logged ``loss.item()``) would find a rank that waited for its peer done as well."""
    probe, engine, backward = paced_probe(monkeypatch)
    assert ("add_host", WAIT, -2.5) in backward(2.5, gap_ms=2.5)  # no later than the span's own time: taken
    calls = backward(2.5, gap_ms=4.0)  # the host waited for the device before its step: kept whole
    assert not [c for c in calls if c[0] == "add_host"] and probe.paced_waiting == 1
    assert (probe.paced_steps, probe.paced_ms) == (1, 2.5) and probe._paced
    probe.bind(None)


def test_the_paced_path_starts_off_where_nothing_could_be_taken(monkeypatch) -> None:
    """On the host clock (no device to ask), and under ``find_unused_parameters`` (DDP reads its used-parameter map
    on the host inside the span), a module's start is the engine's own switch from the first backward."""
    for kw in ({"kind": "host"}, {"find_unused_parameters": True}):
        probe, _, _ = paced_probe(monkeypatch, **kw)
        assert not probe._paced and start_queued(probe) is probe._to_wait
        probe.bind(None)


def test_the_span_loses_the_host_s_time_in_it_less_ddp_s_copies(monkeypatch) -> None:
    probe, engine, backward = paced_probe(monkeypatch, copies_ms=0.5)
    probe._pace(True)
    # caught up: 2.5 ms of the host's in the span, 0.5 of them DDP's copies (taken off every step later): 2.0 here
    assert ("add_host", WAIT, -2.0) in backward(2.5)
    # the host's time in the span no more than the copies: nothing more to take
    calls = backward(0.4)
    assert not [c for c in calls if c[0] == "add_host"] and probe._paced
    assert probe.paced_steps == 1


def test_with_bucket_views_the_answer_itself_turns_the_module_on(monkeypatch) -> None:
    """No copies to time (``gradient_as_bucket_view=True``): a span that ends in Python anyway (a sampled or composed
    backward's) and finds the device at its start turns the module on."""
    probe, engine, backward = paced_probe(monkeypatch, gradient_as_bucket_view=True)
    probe._pace(False)  # off (PACED_OFF answers "behind" in a row)
    engine.behind_is = True
    assert backward(0.25, python=True) == [*PACED, ("switch", "optimizer")] and not probe._paced
    engine.behind_is = False
    assert backward(0.25, python=True) == [*PACED, ("add_host", WAIT, -0.25), ("switch", "optimizer")]
    assert probe._paced and start_queued(probe) == probe._paced_start


def test_under_find_unused_parameters_nothing_is_asked(monkeypatch) -> None:
    """DDP reads its used-parameter map on the host inside the span: the host's time there holds the device's
    wait, so no step loses it."""
    probe, engine, backward = paced_probe(monkeypatch, find_unused_parameters=True)
    engine.calls.clear()
    assert backward(2.5, python=True) == [*PACED, ("switch", "optimizer")]
    probe._pace(True)
    engine.calls.clear()
    backward(2.5)
    assert ("behind",) not in engine.calls and probe.paced_steps == 0


def test_on_the_host_clock_nothing_is_known_and_nothing_taken(monkeypatch) -> None:
    probe, engine, backward = paced_probe(monkeypatch, kind="host")
    engine.behind_is = None  # the host clock's answer
    assert backward(2.5, kept_up=True) == [*PACED, ("switch", "optimizer")]
    assert not probe._paced and start_queued(probe) is probe._to_wait


def test_a_composed_hook_s_sample_loses_what_its_step_loses(monkeypatch) -> None:
    """A composed hook's wait ends in Python every backward: the same rule there, and the sampled exposed wait
    (``comm_wait_ms``, for the hidden share) loses what the step's wait lost, never below zero: once the optimizer
    step answered, so on the next backward's record (a sample is carried on the open record)."""
    probe, engine, backward = paced_probe(monkeypatch, kind="host")
    probe._device = False  # the samples on the host clock (perf_counter_ns, the test's), ...
    engine.behind_is = False  # ... the answer a device's
    probe._pace(True)
    taken = [c for c in backward(0.0, python=True) if c[0] == "add_host"]
    assert taken == []  # nothing in the span: nothing to take, and no sample before it
    for host_ms in (3.0, 1.0, 2.0):
        probe._spans = [[0, 0]]  # one bucket's collective, done at once
        calls = backward(host_ms, python=True)
        assert ("add_host", WAIT, -host_ms) in calls
        if host_ms != 3.0:  # the sample before: its span (the host's time here) less what was taken: 0, never below
            assert ("add_host", comm_run.COMM_WAIT_MS, 0.0) in calls
    assert len(probe._pending) == 1  # the last one: resolved on the next backward's record


def test_a_host_paced_span_whose_device_is_still_in_it_at_the_optimizer_step_keeps_its_wait(monkeypatch) -> None:
    """Issue 47: a rank whose device reached the span's start while the host was in it, then waited there for a
    slower peer's collective, still runs the span when the host reaches its optimizer step: the wait is the span,
    nothing taken (``paced_waiting``).  A host-paced span's device has passed it by then: the host's time comes off.
    A span whose step reaches no optimizer step before the next span begins keeps its wait whole, and every mark
    asked is released."""
    probe, engine, backward = paced_probe(monkeypatch)
    clock = backward.clock
    probe._pace(True)
    assert ("add_host", WAIT, -2.5) in backward(2.5)  # passed by the optimizer step: taken
    clock.done_is = False  # the device still waits in the span at the optimizer step
    calls = backward(2.5)
    assert not [c for c in calls if c[0] == "add_host"] and (probe.paced_steps, probe.paced_waiting) == (1, 1)
    assert probe._paced  # a module still host-paced: a waiting rank's span is a step's, not the module's
    clock.done_is = True
    assert not [c for c in backward(2.5, step=False) if c[0] == "add_host"]  # a synced micro-batch: no step yet
    asked = clock.asked
    assert ("add_host", WAIT, -1.0) in backward(1.0)  # the next span began: the micro-batch's wait stayed whole
    assert clock.asked == asked + 1 and probe.paced_steps == 2 and not clock.live
    probe._pace(False)  # off: the optimizer hooks go
    assert probe._opt_hooks is None
    probe.bind(None)


def test_a_span_inside_the_optimizer_step_is_asked_at_its_post_hook(monkeypatch) -> None:
    """A closure's backward (Lightning's automatic optimization, LBFGS) runs inside ``optimizer.step``, after its
    pre-hooks: its question is asked at the step's post-hook, on the same record, never at the next step's pre-hook
    (a step late, where a waiting device has long passed the span)."""
    probe, engine, backward = paced_probe(monkeypatch)
    clock = backward.clock
    probe._pace(True)
    assert ("add_host", WAIT, -2.5) in backward(2.5)  # the first span is outside a step: it installs the hooks
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    seen: list[list[tuple]] = []

    def closure():  # noqa: ANN202
        seen.append(backward(2.0, step=False))  # the span, inside the step: nothing asked yet
        return None

    clock.done_is = False  # the device waits in the span when the host ends the step
    engine.calls.clear()
    opt.step(closure)
    assert not [c for c in seen[0] if c[0] == "add_host"]
    assert not [c for c in engine.calls if c[0] == "add_host"] and probe.paced_waiting == 1 and not clock.live
    clock.done_is = True
    engine.calls.clear()
    opt.step(closure)
    assert [c for c in engine.calls if c[0] == "add_host"] == [("add_host", WAIT, -2.0)] and not clock.live
    probe.bind(None)


def test_the_optimizer_hooks_hold_the_module_weakly() -> None:
    """Torch's global hook table holds ours for as long as a module is host-paced; a timer never closed must not keep
    the module (and its GPU memory) alive through it, and a dead one's hooks do nothing."""
    import gc
    import weakref

    class Spans(comm_paced.PacedSpans):
        def __init__(self) -> None:
            self.asked: list[bool] = []

        def _at_optimizer(self, post: bool) -> None:
            self.asked.append(post)

    spans = Spans()
    hooks = comm_paced._hook_optimizers(spans)
    try:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        opt.step()
        assert spans.asked == [False, True]
        ref = weakref.ref(spans)
        del spans
        gc.collect()
        assert ref() is None
        opt.step()  # the hooks of a module gone: nothing, and the step runs
    finally:
        for handle in hooks:
            handle.remove()


def test_a_failure_asking_at_the_optimizer_step_warns_once_and_the_step_goes_on(monkeypatch) -> None:
    """A query that raises (a device in error) inside torch's global optimizer pre-hooks: the optimizer step runs,
    one warning says the wait is no longer corrected, nothing is taken from then on, and the hook is not taken off
    while torch goes through its hooks (that would fail the step itself)."""
    probe, engine, backward = paced_probe(monkeypatch)
    clock = backward.clock
    probe._pace(True)

    def broken(mark):  # noqa: ANN001, ANN202
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    clock.done = broken
    with pytest.warns(RuntimeWarning, match="no longer corrected") as seen:
        calls = backward(2.5)  # the optimizer step inside ran
        assert ("switch", "optimizer") in calls and not [c for c in calls if c[0] == "add_host"]
        for _ in range(3):
            assert not [c for c in backward(2.5) if c[0] == "add_host"]
    assert len([w for w in seen if "no longer corrected" in str(w.message)]) == 1
    assert probe.paced_steps == 0 and probe._opt_hooks is not None and not clock.live
    probe.bind(None)
    assert probe._opt_hooks is None


def test_a_failed_question_never_holds_a_composed_hook_s_samples(monkeypatch) -> None:
    """A composed hook's sample waits for its span's question before it is resolved: a question that failed is
    decided (nothing taken), so the samples after it still resolve and none is held for the rest of the run."""
    probe, engine, backward = paced_probe(monkeypatch, kind="host")
    probe._device = False
    engine.behind_is = False
    probe._pace(True)

    def broken(mark):  # noqa: ANN001, ANN202
        raise RuntimeError("CUDA error")

    backward.clock.done = broken
    with pytest.warns(RuntimeWarning, match="no longer corrected"):
        for _ in range(4):
            probe._spans = [[0, 0]]
            calls = backward(1.0, python=True)
    assert len(probe._pending) <= 1  # the newest only, waiting for the next backward
    assert ("add_host", comm_run.COMM_WAIT_MS, 1.0) in calls  # the sample before: its span whole, nothing taken


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


class Caught:
    """The core's engine, answering that the device had caught up at every span's end (a CPU has no device)."""

    def __init__(self, engine) -> None:
        self._inner = engine

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @property
    def current(self):
        return self._inner.current

    def behind(self) -> bool:
        return False


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("composed", [False, True])
def test_a_caught_up_ddp_run_on_gloo_still_adds_up_and_never_reads_below_zero(tmp_path, monkeypatch, native,
                                                                            composed) -> None:
    if not native:
        monkeypatch.setattr(comm_ddp, "Arm", None)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Wide(), gradient_as_bucket_view=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    timer = phase_timer.attach(model, opt, log_dir=str(tmp_path), warmup_steps=1, window=4, per_step=True,
                               summary=False)
    probe = timer._comm[0]
    probe._engine = Caught(probe._engine)
    ends: list[int] = []
    paced_end = comm_ddp.DdpComm._paced_end
    monkeypatch.setattr(comm_ddp.DdpComm, "_paced_end", lambda self: ends.append(1) or paced_end(self))
    if composed:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    lines: list[dict] = []
    consume = timer.core._consume

    def consumed(results):
        consume(results)
        lines.extend(dict(item[2]) for item in results or () if item[0] == "step")

    timer.core._consume = consumed
    for _ in range(9):
        model(torch.randn(8, 2048)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    paced, taken, run = probe._paced, probe.paced_steps, comm_run.find(timer.core)
    totals = timer.close()
    assert taken > 0 and paced  # the sampled backwards saw the device catch up: on
    # the usual path's span ends in Python from then on: 9 steps, 1 of warm-up, 1 off, 1 counting DDP's copies and 3
    # timing them, 3 paced (the composed path ends every span in Python already)
    assert len(ends) == (0 if composed else 3)
    assert len(lines) >= 6 and all(line[WAIT] >= 0 for line in lines)
    phases = {p: t.mean for p, t in totals.phases.items()}
    assert phases[WAIT] >= 0 and totals.phases[WAIT].min >= 0
    inside = [p for p in phases if p in ("h2d", "forward", "backward", "optimizer", "idle")]
    assert sum(phases[p] for p in inside) == pytest.approx(phases["step"], rel=1e-6)
    assert torch._C._len_torch_dispatch_stack() == 0
    if composed:  # the collectives sampled every backward on the host clock; their exposed wait never below zero
        assert run.counts[comm_run.COMM_SAMPLES] >= 6 and run.counts[comm_run.COMM_WAIT_MS] >= 0.0


def test_a_module_whose_copies_are_timed_asks_nothing_once_off_until_a_sample_turns_it_on(monkeypatch) -> None:
    """DDP's defaults (copies into ``.grad``), turned off: only a sample of the copies turns the question on again,
    so a backward that ends in Python without one (a composed hook's, every step) asks the device nothing."""
    probe, engine, backward = paced_probe(monkeypatch)
    probe._pace(False)  # off (PACED_OFF answers "behind" in a row)
    assert probe._copying and not probe._paced
    engine.calls.clear()
    engine.behind_is = False  # were it asked, the device had caught up
    backward(2.5, python=True)
    assert ("behind",) not in engine.calls and probe.paced_steps == 0 and not probe._paced
    backward(2.5, kept_up=True)  # a sample of the copies says caught up: asked, and on
    assert ("behind",) in engine.calls and probe._paced
