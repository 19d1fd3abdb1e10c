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
from phase_timer import comm

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
    if comm.Arm is not None:
        assert isinstance(probe._armed, comm.Arm)
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
    assert comm._PROBES.get(model) is None
    assert nn.parallel.DistributedDataParallel.register_comm_hook is comm._DDP_ORIGINALS.get(
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


@pytest.mark.parametrize("view", [False, True])
def test_the_table_says_when_the_span_holds_ddp_s_copy_into_grad(tmp_path, view: bool) -> None:
    model = ddp(gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, log_dir=str(tmp_path), warmup_steps=1, summary=False)
    train(model, timer, opt, steps=4)
    timer.close()
    assert (comm.COPY_NOTE in timer.last_summary) is not view


def test_a_second_timer_keeps_the_split_when_the_first_closes(tmp_path) -> None:
    model = ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = phase_timer.attach(model, opt, log_dir=str(tmp_path / "1"), warmup_steps=1, summary=False)
    second = phase_timer.attach(model, opt, log_dir=str(tmp_path / "2"), warmup_steps=1, summary=False)
    first.close()
    train(model, second, opt, steps=6)
    assert WAIT in second.close().phases


@pytest.mark.skipif(comm.Arm is None, reason="the C extension is not built")
def test_the_c_hook_decides_as_the_python_one() -> None:
    class Engine:
        current = "backward"

    class Owner:
        flag = True

    queued: list = []
    engine, owner = Engine(), Owner()
    arm = comm.Arm(engine, "backward", owner, "flag", queued.append, "go")
    for current, flag in [("backward", True), ("forward", True), ("backward", False), (None, True)]:
        engine.current, owner.flag = current, flag
        queued.clear()
        assert arm(torch.zeros(1)) is None
        assert queued == (["go"] if (current, flag) == ("backward", True) else [])
    owner.flag, engine.current, queued = True, "backward", None  # queue raises: no split, and no error in backward
    arm2 = comm.Arm(engine, "backward", owner, "missing", queued, "go")
    assert arm2(torch.zeros(1)) is None and comm.Arm(engine, "backward", owner, "flag", None, "go")(1) is None
