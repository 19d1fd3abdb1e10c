"""Memory per phase on a real CUDA device (issue 27), both doors, against the allocator's truth.

The runs are ``benchmarks/memory_truth.py``'s (its docstring says how the truth is read); each test
prints its figures (``MEMORY`` lines); ``python -m benchmarks.memory_truth`` prints the same cases as a table,
recorded in ``benchmarks/results/memory_truth_h100.txt``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DOORS = ["plain", "lightning"]


@pytest.mark.parametrize("door", DOORS)
def test_activations_agree_with_the_allocators_synced_truth_within_1_percent(door):
    from benchmarks.memory_truth import activations_case

    r = activations_case(door)
    print(f"MEMORY {door} activations", {k: round(v, 2) for k, v in r.items()})
    assert r["truth_activations"] > 100  # MB: the LM keeps real activations for backward
    for key in ("forward_begin", "backward_begin", "activations"):
        assert r[key] == pytest.approx(r[f"truth_{key}"], rel=0.01), key


@pytest.mark.parametrize("plant", ["forward", "backward", "optimizer"])
@pytest.mark.parametrize("door", DOORS)
def test_a_planted_512_mb_temporary_is_the_peak_of_its_phase(door, plant):
    from benchmarks.memory_truth import peak_case

    r = peak_case(door, plant)
    print(f"MEMORY {door} peak", r)
    assert r["truth_phase"] == plant  # the planted temporary does set the run's peak (the case is meaningful)
    assert r["phase"] == plant


@pytest.mark.parametrize("door", DOORS)
def test_a_leak_of_8_mb_a_step_is_creep_within_100_steps_and_its_absence_is_not(door):
    from benchmarks.memory_truth import LEAK_MB, creep_case

    leak, steady = creep_case(door, True), creep_case(door, False)
    print(f"MEMORY {door} creep", leak, steady)
    assert leak["creep"] and leak["rate"] == pytest.approx(LEAK_MB, rel=0.1)
    assert not steady["creep"] and abs(steady["rate"]) < 0.1


def test_the_users_max_memory_allocated_is_unchanged_by_the_timer():
    from benchmarks.memory_truth import peak_unchanged_case

    r = peak_unchanged_case()
    print("MEMORY max_memory_allocated", r)
    assert r["with"] == r["without"] == r["without_again"]


def test_reading_memory_adds_no_sync_in_the_profilers_trace():
    from benchmarks.memory_truth import syncs_case

    r = syncs_case()
    print("MEMORY syncs", r)
    assert r["memory"] == r["no_memory"]


# -- issue 39: a real out-of-memory error, explained, with the allocator's snapshot -------------------------------
OOM_AT = 30


class _Grows(torch.nn.Module):
    """A linear layer whose training forward of step OOM_AT asks the allocator for more than the device has."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1024, 1024)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == OOM_AT + 1:
                _, total = torch.cuda.mem_get_info(x.device)
                torch.empty(total + (1 << 30), dtype=torch.uint8, device=x.device)  # a real failed allocation
        return self.lin(x)


def _oom_plain(log_dir: str, syncs: dict[str, int]) -> tuple[torch.OutOfMemoryError, str]:
    """A plain loop that runs out at step 30; the sync calls made while the door explains it (profiled)."""
    import phase_timer
    from benchmarks.memory_truth import SYNC_CALLS, _profiler
    from phase_timer.measures import oom

    model = _Grows().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [(torch.randn(64, 1024, device="cuda"), torch.randn(64, 1024, device="cuda")) for _ in range(40)]
    real = oom.caught

    def count(fn) -> int:
        prof = _profiler()
        with prof:
            fn()
        names = [e.name for e in prof.events()]
        return sum(names.count(n) for n in SYNC_CALLS)

    def profiled(*args, **kwargs):  # the door's call, under the profiler, beside an empty block under it (the
        # profiler's own end synchronizes): what the out-of-memory path adds
        syncs["empty"] = count(lambda: None)
        syncs["oom_path"] = count(lambda: real(*args, **kwargs))

    oom.caught = profiled
    try:
        with pytest.raises(torch.OutOfMemoryError) as raised:
            with phase_timer.attach(model, opt, data, log_dir=log_dir, warmup_steps=5, summary=False,
                                    memory_snapshot=True) as timer:
                for x, y in timer.loader:
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
    finally:
        oom.caught = real
    return raised.value, timer.summary_path


def _oom_lightning(log_dir: str) -> tuple[torch.OutOfMemoryError, str]:
    import lightning.pytorch as pl

    import phase_timer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _Grows()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    timer = phase_timer.PhaseTimer(warmup_steps=5, summary=False, log_dir=log_dir, memory_snapshot=True)
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=40, logger=False, callbacks=[timer],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    data = torch.utils.data.TensorDataset(torch.randn(64 * 40, 1024), torch.randn(64 * 40, 1024))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=64))
    assert "batch_to_device" not in trainer.strategy.__dict__ and timer.core is None
    return raised.value, timer.summary_path


@pytest.mark.parametrize("door", DOORS)
def test_a_real_out_of_memory_in_forward_is_explained_with_a_loadable_snapshot_and_no_sync(door, tmp_path):
    import json
    import pickle

    from phase_timer.outputs.run_summary import schema

    try:  # the device machine has no jsonschema: the CPU tests validate the same file's form there
        import jsonschema
    except ImportError:
        jsonschema = None

    torch.cuda.empty_cache()
    backward = torch.autograd.backward
    syncs: dict[str, int] = {}
    error, path = _oom_plain(str(tmp_path), syncs) if door == "plain" else _oom_lightning(str(tmp_path))
    assert torch.autograd.backward is backward
    assert "Tried to allocate" in str(error)
    with open(path) as f:
        data = json.load(f)
    if jsonschema is not None:
        jsonschema.validate(data, schema())
    facts = data["oom"]
    print(f"MEMORY {door} oom", {k: facts[k] for k in ("step", "phase", "requested_mb", "allocator", "snapshot")},
          "syncs", syncs)
    assert (facts["step"], facts["phase"], facts["in_step"]) == (OOM_AT, "forward", True)
    _, total = torch.cuda.mem_get_info()
    assert facts["requested_mb"] == pytest.approx((total + (1 << 30)) / 2**20, rel=0.01)
    assert facts["reported"]["total_mb"] == pytest.approx(total / 2**20, rel=0.01)
    assert facts["allocator"]["allocated_mb"] > 0 and facts["allocator"]["device_total_mb"] == pytest.approx(total / 2**20)
    assert facts["held"]["last_step"] is not None and "activations" in facts["held"]["last_mb"]
    assert data["diagnosis"]["kind"] == "OUT_OF_MEMORY" and "at step 30, in forward" in data["diagnosis"]["why"]
    # the snapshot: written at the error, loadable, for PyTorch's viewer; the recording stopped at the end
    assert facts["snapshot"] == data["memory_snapshot"]["path"] and data["memory_snapshot"]["dumped"] == "oom"
    with open(facts["snapshot"], "rb") as f:
        snap = pickle.load(f)
    assert "segments" in snap and any(e.get("action") == "oom" for trace in snap["device_traces"] for e in trace)
    before = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
    keep = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"]) == before  # not recorded any more
    del keep
    if door == "plain":  # no sync while the door explains it (the run's one wait, its drain, comes after)
        assert syncs and syncs["oom_path"] == syncs["empty"], syncs


def test_the_hf_trainer_names_a_backward_temporary_and_explains_a_real_out_of_memory(tmp_path):
    """The 🤗 door on the device: a 512 MB temporary made and freed inside backward every step is the peak's
    phase; a real allocation the device cannot hold, in the transformer's forward at step 30, is explained."""
    import gc
    import json

    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import phase_timer
    from benchmarks.models import Tokens

    # The process's peak counter starts from this run.  Earlier tests in this process leave garbage (reference
    # cycles holding CUDA tensors, ~2 GB): uncollected, it is allocated at the reset, and a collection during the
    # run frees it, so the counter's peak stays the reset's, "before the first sampled step", as phase-timer then
    # rightly says.  Collected first, as a user's fresh process is.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=128, n_embd=128, n_layer=2, n_head=2))
    _, total = torch.cuda.mem_get_info()
    calls: list[int] = []

    def in_forward(module, args):
        if module.training:
            calls.append(1)
            if len(calls) == 31:  # global_step 30 (the first step is 0)
                torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")

    def in_backward(module, grad_in, grad_out):
        t = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        del t

    model.transformer.register_forward_pre_hook(in_forward)
    model.lm_head.register_full_backward_hook(in_backward)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=50, logging_steps=10,
                             disable_tqdm=True, report_to="none", save_strategy="no")
    cb = phase_timer.PhaseTimerCallback(summary=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(400, 128, vocab=1000), callbacks=[cb])
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    with open(cb.summary_path) as f:
        data = json.load(f)
    mem, facts = data["memory"], data["oom"]
    print("MEMORY hf", {k: mem[k] for k in ("peak_phase", "peak_allocated_mb", "phase_peaks_mb")},
          {k: facts[k] for k in ("step", "phase", "requested_mb")})
    assert mem["peak_phase"] == "backward" and max(mem["phase_peaks_mb"], key=mem["phase_peaks_mb"].get) == "backward"
    assert (facts["step"], facts["phase"]) == (30, "forward") and data["diagnosis"]["kind"] == "OUT_OF_MEMORY"
    assert facts["requested_mb"] == pytest.approx((total + (1 << 30)) / 2**20, rel=0.01)
