"""An out-of-memory crash, explained (issue 39, part 2): every door, on real loops and Trainers, on the CPU.

The error is planted: ``torch.OutOfMemoryError`` with the CUDA allocator's message, raised inside the
model's forward (or its backward, or the loader) at step 30.  What must hold: the user gets the very
exception back, the run is written with an ``OUT_OF_MEMORY`` verdict that names the phase and the step,
every hook is put back; the advice follows what was measured (a planted allocator,
``tests/fakes.py``, gives the CPU memory figures).  ``memory_snapshot=``'s own recording needs CUDA:
``tests/test_gpu_memory.py``; here its arguments, its CPU warning and its file handling.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.measures import memory as timer_memory
from phase_timer.measures import oom, snapshot
from phase_timer.diagnosis import out_of_memory
from phase_timer.outputs.run_summary import schema
from tests.fakes import FakeAllocator
from tests.helpers import loader, trainer
from tests.stories.test_first_day import PLAIN_LOOP, run_script
from tests.doors.test_loop import hook_state

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: What the CUDA caching allocator says (torch 2.x), its figures planted.
MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
           "1.25 GiB is free. Including non-PyTorch memory, this process has 77.93 GiB memory in use. Of the "
           "allocated memory 75.60 GiB is allocated by PyTorch, and 1.71 GiB is reserved by PyTorch but "
           "unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
AT = 30  # the step whose forward runs out


class OomNet(nn.Module):
    """A small net whose training forward of step ``at`` (0-based, one forward a step) raises ``error``;
    ``fake``: a planted allocator that its forward fills with ``act_mb`` of activations."""

    def __init__(self, error: BaseException, at: int = AT, fake: FakeAllocator | None = None,
                 act_mb: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.error, self.at, self.fake, self.act_mb = error, at, fake, act_mb
        self.calls = 0
        self.raise_in_eval = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at + 1:
                raise self.error
            if self.fake is not None:
                self.fake.alloc(self.act_mb)
        elif self.raise_in_eval:
            raise self.error
        return self.net(x)


def summary_of(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    jsonschema.validate(data, schema())
    return data


def plain_run(tmp_path: Any, model: nn.Module, *, steps: int = 50, body: Any = None, **kw: Any) -> Any:
    """A plain loop over ``steps`` batches; returns (the timer, the exception that reached the caller)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(steps)]
    kw.setdefault("warmup_steps", 5)
    caught = None
    timer = None
    try:
        with phase_timer.attach(model, opt, data, log_dir=tmp_path, summary=False, **kw) as timer:
            (body or _train)(timer, model, opt)
    except BaseException as err:  # noqa: BLE001 - the test looks at what came out
        caught = err
    return timer, caught


def _train(timer: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for x, y in timer.loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def finding(summary: dict) -> dict:
    d = summary["diagnosis"]
    assert d["kind"] == "OUT_OF_MEMORY" and d["severity"] == "high", d["kind"]
    return d


# -- every door: the exception unchanged, the run written, hooks put back ----------------------------
def test_a_plain_loop_that_runs_out_in_forward_is_explained_and_the_error_goes_on_unchanged(tmp_path):
    error = torch.OutOfMemoryError(MESSAGE)
    model = OomNet(error)
    opt_probe = torch.optim.SGD(model.parameters(), lr=0.01)
    before, backward = hook_state(model, [opt_probe]), torch.autograd.backward
    timer, caught = plain_run(tmp_path, model)
    assert caught is error  # the very object, untouched
    assert caught.__traceback__ is not None and str(caught) == MESSAGE
    assert hook_state(model, [opt_probe]) == before and torch.autograd.backward is backward
    data = summary_of(timer.summary_path)
    assert data["interrupted"] is True
    facts = data["oom"]
    assert (facts["step"], facts["phase"], facts["in_step"], facts["warmup"]) == (AT, "forward", True, False)
    assert facts["requested_mb"] == 2048.0 and facts["exception"] == "torch.OutOfMemoryError"
    assert facts["reported"] == pytest.approx({"device": 0, "total_mb": 79.19 * 1024, "free_mb": 1.25 * 1024,
                                               "process_mb": 77.93 * 1024, "allocated_mb": 75.60 * 1024,
                                               "reserved_unallocated_mb": 1.71 * 1024})
    assert facts["allocator"] is None and facts["held"] is None  # a CPU: no allocator to read
    assert facts["state_mb"]["weights_mb"] > 0 and facts["state_mb"]["optimizer_state_mb"] > 0  # momentum buffers
    d = finding(data)
    assert "at step 30, in forward" in d["why"] and "an allocation of 2.00 GiB failed" in d["why"]
    assert d["evidence"]["when"] == "unknown"  # memory not read: creep and a one-off cannot be told apart
    assert "verdict: OUT_OF_MEMORY (high)" in timer.last_summary and "(interrupted)" in timer.last_summary


def test_lightning_runs_out_in_forward_explained_restored_and_the_error_goes_on(tmp_path):
    ns = "lightning.pytorch"
    pl = pytest.importorskip(ns)
    error = torch.OutOfMemoryError(MESSAGE)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = OomNet(error)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    timer = phase_timer.PhaseTimer(warmup_steps=2, log_dir=tmp_path / "pt", summary=False)
    t = trainer(ns, str(tmp_path), [timer], max_steps=50, logger=False)
    backward = torch.autograd.backward
    with pytest.raises(torch.OutOfMemoryError) as raised:
        t.fit(Module(), loader())
    assert raised.value is error
    assert "batch_to_device" not in t.strategy.__dict__ and timer.core is None  # patches put back, run closed
    assert torch.autograd.backward is backward
    assert not t.fit_loop.epoch_loop.__dict__.keys() & {"_on_before_fetch", "_on_after_fetch"}
    data = summary_of(timer.summary_path)
    assert data["interrupted"] and data["door"] == "lightning"
    assert (data["oom"]["step"], data["oom"]["phase"]) == (AT, "forward")
    assert "at step 30, in forward" in finding(data)["why"]
    assert "verdict: OUT_OF_MEMORY" in timer.last_summary


def test_the_hf_trainer_runs_out_in_forward_explained_restored_and_the_error_goes_on(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tests.doors.test_hf_trainer import Tokens

    error = torch.OutOfMemoryError(MESSAGE)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                                       eos_token_id=0))
    calls = []

    def inside_forward(module: nn.Module, args: Any) -> None:  # the transformer's own forward, inside the model's
        if module.training:
            calls.append(1)
            if len(calls) == AT + 1:
                raise error

    model.transformer.register_forward_pre_hook(inside_forward)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=50, logging_steps=10,
                             use_cpu=True, disable_tqdm=True, report_to="none", save_strategy="no")
    cb = phase_timer.PhaseTimerCallback(warmup_steps=2, summary=False)
    tr = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    backward = torch.autograd.backward
    with pytest.raises(torch.OutOfMemoryError) as raised:
        tr.train()
    assert raised.value is error
    assert torch.autograd.backward is backward
    assert "_inner_training_loop" in tr.__dict__ and not tr.__dict__.keys() & {
        "get_batch_samples", "training_step", "_evaluate", "_save_checkpoint", "_finalize_training"}
    data = summary_of(cb.summary_path)
    assert data["interrupted"] and data["door"] == "transformers"
    assert (data["oom"]["step"], data["oom"]["phase"]) == (AT, "forward")  # steps are numbered by global_step
    assert "at step 30, in forward" in finding(data)["why"]


# -- where it happened: the plain door's loader is closed before the door hears of the error ----------
class _OomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError(MESSAGE)


def test_a_backward_that_runs_out_is_backwards_not_the_optimizers(tmp_path):
    def body(timer: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for i, (x, y) in enumerate(timer.loader):
            out = model(x)
            if i == AT:
                out = _OomInBackward.apply(out)
            nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()

    timer, caught = plain_run(tmp_path, OomNet(RuntimeError("never"), at=10**6), body=body)
    assert isinstance(caught, torch.OutOfMemoryError)
    facts = summary_of(timer.summary_path)["oom"]
    assert (facts["step"], facts["phase"], facts["in_step"]) == (AT, "backward", True)


def test_a_loop_inside_a_function_still_names_forward(tmp_path):
    def train(timer: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        _train(timer, model, opt)  # the loader is iterated (and closed) one frame further in

    timer, _ = plain_run(tmp_path, OomNet(torch.OutOfMemoryError(MESSAGE)), body=train)
    assert summary_of(timer.summary_path)["oom"]["phase"] == "forward"


def test_a_loader_that_runs_out_is_data_wait_between_steps(tmp_path):
    model = OomNet(RuntimeError("never"), at=10**6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches() -> Any:
        for i in range(50):
            if i == AT:
                raise torch.OutOfMemoryError(MESSAGE)  # a collate on the device, say
            yield torch.randn(8, 16), torch.randn(8, 1)

    class Loader:
        def __iter__(self) -> Any:
            return batches()

    with pytest.raises(torch.OutOfMemoryError):
        with phase_timer.attach(model, opt, Loader(), log_dir=tmp_path, summary=False, warmup_steps=2) as timer:
            _train(timer, model, opt)
    facts = summary_of(timer.summary_path)["oom"]
    assert (facts["phase"], facts["in_step"], facts["step"]) == ("data_wait", False, AT - 1)
    assert "in data_wait, after step 29" in summary_of(timer.summary_path)["diagnosis"]["why"]


def test_an_error_after_the_loop_broke_off_is_where_it_came_not_where_the_loop_stopped(tmp_path):
    """``break`` closes the loader too: that close must not be taken for the error's."""
    model = OomNet(torch.OutOfMemoryError(MESSAGE), at=10**6)

    def body(timer: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for i, (x, y) in enumerate(timer.loader):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if i == 9:
                break  # the step has ended: "between_steps" when the loader is closed
        model.eval()
        model.raise_in_eval = True
        with torch.no_grad():
            model(x)  # evaluation: paused

    timer, caught = plain_run(tmp_path, model, body=body, warmup_steps=2)
    assert isinstance(caught, torch.OutOfMemoryError)
    facts = summary_of(timer.summary_path)["oom"]
    assert (facts["phase"], facts["in_step"], facts["step"]) == ("paused", False, 9)


def test_an_error_raised_from_an_out_of_memory_error_is_explained_and_other_errors_are_not(tmp_path):
    def wrapped(timer: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        try:
            _train(timer, model, opt)
        except torch.OutOfMemoryError as err:
            raise RuntimeError("the step failed") from err

    timer, caught = plain_run(tmp_path / "a", OomNet(torch.OutOfMemoryError(MESSAGE)), body=wrapped)
    assert type(caught) is RuntimeError and str(caught) == "the step failed"
    assert summary_of(timer.summary_path)["oom"]["phase"] == "forward"
    timer, caught = plain_run(tmp_path / "b", OomNet(RuntimeError("not memory")))
    data = summary_of(timer.summary_path)
    assert str(caught) == "not memory" and data["oom"] is None and data["diagnosis"]["kind"] != "OUT_OF_MEMORY"


def test_close_in_a_finally_without_with_still_explains_it(tmp_path):
    model = OomNet(torch.OutOfMemoryError(MESSAGE))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(50)]
    timer = phase_timer.attach(model, opt, data, log_dir=tmp_path, summary=False)
    with pytest.raises(torch.OutOfMemoryError):
        try:
            _train(timer, model, opt)
        finally:
            timer.close()
    got = summary_of(timer.summary_path)
    assert got["oom"]["phase"] == "forward" and got["interrupted"] is True


def test_an_uncaught_out_of_memory_error_without_close_is_explained_at_exit(tmp_path):
    out = run_script(PLAIN_LOOP + """
class Boom(nn.Module):
    def __init__(self):
        super().__init__(); self.inner = model; self.n = 0
    def forward(self, x):
        self.n += 1
        if self.n == 31:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return self.inner(x)
boom = Boom()
timer = phase_timer.attach(boom, opt, loader, log_dir=LOG, warmup_steps=2, window=10)
for x, y in timer.loader:
    opt.zero_grad(); ((boom(x) - y) ** 2).mean().backward(); opt.step()
""", tmp_path)
    assert out.returncode != 0 and "torch.OutOfMemoryError: CUDA out of memory" in out.stderr
    assert "verdict: OUT_OF_MEMORY" in out.stdout
    with open(tmp_path / "logs" / "version_0" / "phase_timer_summary.json") as f:
        facts = json.load(f)["oom"]
    assert (facts["step"], facts["phase"], facts["requested_mb"]) == (30, "forward", 20.0)


# -- what was held, and advice that fits it (a planted allocator) ----------------------------------
def _planted(monkeypatch: pytest.MonkeyPatch, fake: FakeAllocator) -> None:
    monkeypatch.setattr(timer_memory, "reader_for", lambda clock: (fake.read, fake.info))


def _memory_body(fake: FakeAllocator, act_mb: float, leak_mb: float) -> Any:
    def body(timer: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for x, y in timer.loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)  # its forward allocates act_mb
            loss.backward()
            fake.free(act_mb)  # backward frees the activations
            opt.step()
            fake.alloc(leak_mb)  # kept across steps
    return body


@pytest.mark.parametrize("leak_mb", [0.0, 8.0])
def test_what_each_phase_held_and_a_creep_are_told_apart_from_a_steady_run(tmp_path, monkeypatch, leak_mb):
    fake = FakeAllocator(total_mb=16 * 1024)
    fake.alloc(1000.0)  # weights, gradients, optimizer state
    _planted(monkeypatch, fake)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")  # no figures: the door's read
    model = OomNet(error, fake=fake, act_mb=3000.0)
    timer, caught = plain_run(tmp_path, model, body=_memory_body(fake, 3000.0, leak_mb))
    assert caught is error
    data = summary_of(timer.summary_path)
    facts, d = data["oom"], finding(data)
    held = facts["held"]
    assert held["last_step"] < AT and held["last_mb"]["activations"] == pytest.approx(3000.0)
    assert held["last_mb"]["step_begin"] == pytest.approx(1000.0 + leak_mb * held["last_step"])
    assert facts["allocator"]["allocated_mb"] == pytest.approx(1000.0 + leak_mb * AT)  # read at the door
    assert facts["allocator"]["device_total_mb"] == 16 * 1024
    assert "the last memory step (step" in d["why"] and "activations 2.93 GiB" in d["why"]
    assert any(t.startswith("activations (2.93 GiB") and "activation checkpointing" in t for t in d["next"])
    if leak_mb:
        assert d["evidence"]["when"] == "creep" and "rising 8.00 MiB a step" in d["why"]
        assert "a tensor kept across steps" in d["next"][0]
    else:
        assert d["evidence"]["when"] == "steady" and "with memory steady" in d["why"]


def test_the_first_step_running_out_says_it_never_fit_and_leads_without_twenty_steps(tmp_path, monkeypatch):
    fake = FakeAllocator(total_mb=16 * 1024)
    _planted(monkeypatch, fake)
    timer, caught = plain_run(tmp_path, OomNet(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"),
                                               at=1, fake=fake, act_mb=10.0))
    data = summary_of(timer.summary_path)
    d = finding(data)  # not TOO_FEW_STEPS: the error leads whatever the number of steps timed
    assert data["steps"]["timed"] == 0 and d["evidence"]["when"] == "first" and data["oom"]["warmup"] is True
    assert "at step 1 (a warm-up step), in forward" in d["why"] and "one step never fit" in d["why"]
    assert "verdict: OUT_OF_MEMORY" in timer.last_summary


def _facts(**kw: Any) -> dict[str, Any]:
    base = {"rank": None, "step": 40, "in_step": True, "phase": "optimizer", "steps_begun": 41, "warmup": False,
            "exception": "torch.OutOfMemoryError", "message": "", "requested_mb": 512.0, "reported": None,
            "allocator": {"allocated_mb": 30000.0, "reserved_mb": 30100.0, "peak_allocated_mb": 30500.0,
                          "peak_reserved_mb": 31000.0, "device_free_mb": 300.0, "device_total_mb": 32768.0},
            "held": None, "state_mb": {"weights_mb": 4000.0, "gradients_mb": 4000.0, "optimizer_state_mb": 2000.0},
            "snapshot": None}
    base.update(kw)
    return base


def test_the_advice_follows_what_was_measured(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    quiet = out_of_memory(_facts(), None)
    assert not any("expandable_segments" in t or "leaner optimizer" in t or "activation checkpointing" in t
                   for t in quiet.next)  # nothing measured says so (the optimizer's phase, 2 GB of 32 GB state)
    assert "memory_snapshot=True" in quiet.next[-1]
    # the cache held more than the request, in pieces: expandable segments (unless already on)
    frag = _facts(allocator={**_facts()["allocator"], "reserved_mb": 31000.0})
    assert any(t.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: 1000 MiB was reserved but unallocated")
               for t in out_of_memory(frag, None).next)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not any("expandable" in t for t in out_of_memory(frag, None).next)
    # Adam's state at a quarter of the device
    adam = _facts(state_mb={"weights_mb": 4000.0, "gradients_mb": 4000.0, "optimizer_state_mb": 8200.0})
    assert any("the optimizer's state is 8.01 GiB, 2.0x the weights: a leaner optimizer" in t
               for t in out_of_memory(adam, None).next)
    # activations measured large: checkpointing, with their share
    acts = _facts(held={"last_step": 38, "last_mb": {"step_begin": 10000.0, "activations": 15000.0},
                        "phase_peaks_mb": {"backward": 30400.0}, "this_step": None})
    d = out_of_memory(acts, None)
    assert "activations 14.65 GiB, backward reached 29.69 GiB" in d.why
    assert any(t.startswith("activations (14.65 GiB, 49% of what the step wanted)") for t in d.next)
    # a snapshot: opening it is the first thing to do
    snap = out_of_memory(_facts(snapshot="/runs/x/memory_snapshot.pickle"), None)
    assert snap.next[0].startswith("open /runs/x/memory_snapshot.pickle at https://pytorch.org/memory_viz")
    assert not any("memory_snapshot=True" in t for t in snap.next)
    assert out_of_memory(_facts(rank=3), None).why.startswith("rank 3 ran out of device memory at step 40, in optimizer")


def test_the_allocators_message_is_read_in_every_unit():
    got = oom.parse_message("CUDA out of memory. Tried to allocate 512 bytes. GPU 3 has a total capacity of "
                            "15.77 GiB of which 20.50 MiB is free.")
    assert got == pytest.approx({"requested_mb": 512 / 2**20, "device": 3, "total_mb": 15.77 * 1024, "free_mb": 20.5})
    assert oom.parse_message("Tried to allocate 64.00 KiB")["requested_mb"] == pytest.approx(1 / 16)
    assert oom.parse_message("MPS backend out of memory")["requested_mb"] is None


# -- memory_snapshot= ------------------------------------------------------------------------------
def test_memory_snapshot_is_checked_at_construction_naming_it(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (3, 1.5, "", tmp_path):  # tmp_path: an existing directory, not a file
        with pytest.raises(ValueError, match=r"attach\(memory_snapshot=.*`memory_snapshot` must be"):
            phase_timer.attach(model, opt, memory_snapshot=bad)
    with pytest.raises(ValueError, match=r"PhaseTimer\(memory_snapshot=3\)"):
        phase_timer.PhaseTimer(memory_snapshot=3)
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"PhaseTimerCallback\(memory_snapshot=1.5\)"):
        phase_timer.PhaseTimerCallback(memory_snapshot=1.5)


def test_memory_snapshot_on_a_cpu_warns_once_and_the_run_goes_on(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"memory_snapshot=True: it needs a CUDA device") as said:
        timer, caught = plain_run(tmp_path, OomNet(torch.OutOfMemoryError(MESSAGE)), memory_snapshot=True)
    assert len([w for w in said if "memory_snapshot" in str(w.message)]) == 1
    data = summary_of(timer.summary_path)
    assert isinstance(caught, torch.OutOfMemoryError) and data["oom"]["snapshot"] is None
    snap = data["memory_snapshot"]
    assert snap["error"].startswith("it needs a CUDA device") and snap["path"] is None and snap["dumped"] is None


class _FakeCudaMemory:
    """``torch.cuda.memory``'s recording, on the CPU: what was asked, and a snapshot to dump."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def record(self, enabled: Any = "all", **kw: Any) -> None:
        self.calls.append({"enabled": enabled, **kw})

    def snapshot(self) -> dict[str, Any]:
        return {"segments": [{"total_size": 1 << 20}], "device_traces": [[{"action": "oom"}]]}


def _cuda_core(rank: int | None = None) -> Any:
    ranks = None if rank is None else SimpleNamespace(rank=rank)
    return SimpleNamespace(clock=SimpleNamespace(kind="cuda"), ranks=ranks)


def test_a_snapshot_is_recorded_bounded_dumped_on_the_error_and_stopped_at_the_end(tmp_path, monkeypatch):
    fake = _FakeCudaMemory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake.snapshot)
    snap = snapshot.Snapshot.start(True, _cuda_core(), str(tmp_path))
    assert fake.calls == [{"enabled": "all", "context": "all", "stacks": "python", "max_entries": snapshot.SNAPSHOT_ENTRIES}]
    path = snap.dump("oom")
    assert path == str(tmp_path / "memory_snapshot.pickle") and os.listdir(tmp_path) == ["memory_snapshot.pickle"]
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"][0]["total_size"] == 1 << 20
    assert snap.end(None) == []  # the measure's end: recording stops
    assert fake.calls[-1] == {"enabled": None} and snap.summary()["dumped"] == "oom"
    # "end": written at the end of a run that did not run out; a path of the user's, one file per rank
    end = snapshot.Snapshot.start("end", _cuda_core(), str(tmp_path / "other"))
    end.end(None)
    assert end.summary()["dumped"] == "end" and os.path.isfile(tmp_path / "other" / "memory_snapshot.pickle")
    mine = snapshot.Snapshot.start(str(tmp_path / "mine" / "snap.pickle"), _cuda_core(2), None)
    assert mine.dump("oom") == str(tmp_path / "mine" / "snap.rank2.pickle")
    mine.end(None)
    assert not os.path.exists(tmp_path / "mine" / "snap.pickle")


# -- the measure ----------------------------------------------------------------------------------
def _core(measures: list[Any]) -> Any:
    from phase_timer.run.core import TimingCore
    from phase_timer.timing.clock import HostClock

    return TimingCore(HostClock(), [], window=10, warmup_steps=0, max_pending=8, measures=measures)


def test_the_error_is_the_measures_its_summary_block_and_the_verdicts_keyword():
    measure = oom.OutOfMemory()
    core = _core([measure])
    assert (core.oom, core.verdict().kind) == (None, "TOO_FEW_STEPS")
    oom.caught(RuntimeError("wrapped"), core, None)  # not an out-of-memory error: nothing noted
    assert measure.facts is None
    oom.caught(torch.OutOfMemoryError(MESSAGE), core, None)
    facts = measure.facts
    assert facts["requested_mb"] == 2048.0 and core.oom is facts and oom.own(core)
    assert core.verdict().kind == "OUT_OF_MEMORY"  # handed through Measure.verdict: nobody passes oom=
    oom.caught(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"), core, None)
    assert measure.facts is facts and facts["requested_mb"] == 2048.0  # the first one only
    core.finish()
    assert core.diagnosis.kind == "OUT_OF_MEMORY"
    from phase_timer.outputs.run_summary import build_summary

    data = build_summary(core)
    assert data["oom"] == facts and data["memory_snapshot"] is None  # not asked: null
    jsonschema.validate(json.loads(json.dumps(data, default=str)), schema())


def test_a_core_made_without_the_measure_notes_nothing_and_writes_what_the_schema_asks():
    from phase_timer.outputs.run_summary import build_summary

    core = _core([])
    oom.caught(torch.OutOfMemoryError(MESSAGE), core, None)  # never raises; nothing listens for it
    assert core.oom is None and not oom.own(core)
    core.finish()
    data = build_summary(core)
    assert data["oom"] is None and data["memory_snapshot"] is None and core.diagnosis.kind != "OUT_OF_MEMORY"
    jsonschema.validate(json.loads(json.dumps(data, default=str)), schema())


def test_the_doors_register_the_measure_and_the_snapshot_only_where_asked(tmp_path):
    model = OomNet(torch.OutOfMemoryError(MESSAGE), at=10**6)
    plain = phase_timer.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=tmp_path, summary=False)
    try:
        kinds = [type(m) for m in plain.core.measures]
        assert oom.OutOfMemory in kinds and snapshot.Snapshot not in kinds
    finally:
        plain.close()
    with pytest.warns(RuntimeWarning, match="memory_snapshot=True"):
        asked = phase_timer.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=tmp_path / "b",
                                   summary=False, memory_snapshot=True)
    try:
        snap = asked.core.measure("memory_snapshot")
        assert isinstance(snap, snapshot.Snapshot) and [type(m) for m in asked.core.measures][:2] == [snapshot.Snapshot,
                                                                                            oom.OutOfMemory]
    finally:
        asked.close()
    assert summary_of(asked.summary_path)["memory_snapshot"] == snap.summary()


# -- torch.distributed: the rank that ran out writes its own; rank zero names it ------------------
def test_a_rank_that_runs_out_writes_its_own_finding_and_rank_zero_names_it(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "tests", "dist_scripts", "oom_ranks.py"), "--log-dir", str(tmp_path), "--oom-at", str(AT)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RANK1OOM" in proc.stdout  # the script got rank 1's error back, and kept the job alive
    run = tmp_path / "version_0"
    assert sorted(os.listdir(run)) == sorted(
        [*(p for p in os.listdir(run) if p.startswith("events.")), "phase_timer_summary.json",
         "phase_timer_summary.rank1.json", "phase_timer_live.json"])  # the live file: rank zero's, for `watch`
    rank1 = summary_of(str(run / "phase_timer_summary.rank1.json"))
    assert rank1["environment"]["rank"] == 1
    assert (rank1["oom"]["rank"], rank1["oom"]["step"], rank1["oom"]["phase"]) == (1, AT, "forward")
    assert finding(rank1)["why"].startswith("rank 1 ran out of device memory at step 30, in forward")
    zero = summary_of(str(run / "phase_timer_summary.json"))
    assert zero["environment"]["rank"] == 0 and zero["interrupted"] is False
    assert zero["oom"]["rank"] == 1 and zero["oom"]["ranks_out_of_memory"] == [1]
    assert finding(zero)["why"].startswith("rank 1 ran out of device memory at step 30, in forward")
