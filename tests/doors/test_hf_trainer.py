"""The 🤗 door on real ``transformers.Trainer`` runs (a tiny GPT-2 from a config, on the CPU).

Where each planted wait lands is the conformance suite's job (``tests/doors/test_loop_patterns.py``,
the ``🤗 Trainer`` rows); here: where the values go, what a second ``train()`` and a failing
one leave behind, and that bad configuration fails fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from phase_timer.doors.hf_trainer import DEFAULT_DIR, PhaseTimerCallback  # noqa: E402
from tests.helpers import hours, read_scalars  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, fail_after: int | None = None) -> None:
        self.n, self.fail_after, self.read = n, fail_after, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read += 1
        if self.read == self.fail_after:
            raise RuntimeError("a corrupt sample")
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer(tmp_path: Any, callback: PhaseTimerCallback, *, steps: int = 30, data: Any = None, **kw: Any) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    kw.setdefault("report_to", "none")
    kw.setdefault("save_strategy", "no")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                             logging_steps=10, use_cpu=True, disable_tqdm=True, **kw)
    return Trainer(model=model, args=args, train_dataset=data or Tokens(), callbacks=[callback])


def test_values_go_to_the_trainers_tensorboard_run_at_its_global_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    trainer(tmp_path, cb, report_to="tensorboard").train()
    timer = cb.timer
    assert timer.log_dir == str(tmp_path / "tb")  # where the Trainer's own TensorBoard callback writes
    scalars = read_scalars(timer.log_dir)
    assert "train/loss" in scalars  # the Trainer's own values, in the same run
    steps = [s for s, _ in scalars["phase_time/forward_ms/mean"]]
    assert steps == [10, 20, 30]  # windows of logging_steps, at the Trainer's global_step
    assert timer.totals.steps == 28
    with open(timer.summary_path) as f:
        data = json.load(f)
    assert os.path.dirname(timer.summary_path) == timer.log_dir
    assert data["door"] == "transformers" and data["steps"]["timed"] == 28 and not data["interrupted"]
    assert data["environment"]["optimizers"][0]["type"] == "AdamW"  # the optimizer under accelerate's wrapper


def test_without_tensorboard_it_writes_under_the_output_dir(tmp_path):
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    trainer(tmp_path, cb, steps=12).train()
    assert cb.timer.log_dir == str(tmp_path / DEFAULT_DIR / "version_0")
    assert "phase_time/step_ms/mean" in read_scalars(cb.timer.log_dir)


def test_train_twice_times_each_and_leaves_the_trainer_as_it_was(tmp_path, capsys):
    cb = PhaseTimerCallback(warmup_steps=2)
    t = trainer(tmp_path, cb, steps=12)
    t.train()
    first = cb.timer
    assert "get_batch_samples" not in t.__dict__ and "training_step" not in t.__dict__  # the class's own again
    t.args.max_steps = 24
    t.train()
    assert cb.timer is not first and first.totals.steps == 10 and cb.timer.totals.steps == 22
    assert capsys.readouterr().out.count("phase-timer: ") >= 2  # a table at the end of each train()
    assert not set(t.__dict__) & {"get_batch_samples", "training_step", "_evaluate", "_save_checkpoint"}


def test_a_train_that_raises_keeps_what_was_timed(tmp_path):
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    t = trainer(tmp_path, cb, steps=40, data=Tokens(fail_after=4 * 25 + 1))  # in the 26th batch
    with pytest.raises(RuntimeError, match="corrupt sample"):
        t.train()
    with open(cb.timer.summary_path) as f:
        data = json.load(f)
    assert data["interrupted"] and data["steps"]["timed"] == 22  # 25 batches (one read ahead), 2 warm-up, 1 cut off
    assert "get_batch_samples" not in t.__dict__  # put back


def test_bad_configuration_fails_at_construction_naming_the_argument():
    with pytest.raises(ValueError, match=r"PhaseTimerCallback\(warmup_steps=-1\)"):
        PhaseTimerCallback(warmup_steps=-1)
    with pytest.raises(ValueError, match=r"`enabled` must be True or False"):
        PhaseTimerCallback(enabled="yes")


def test_disabled_times_nothing_and_touches_nothing(tmp_path):
    cb = PhaseTimerCallback(enabled=False)
    t = trainer(tmp_path, cb, steps=5)
    t.train()
    assert cb.timer is None and not (tmp_path / DEFAULT_DIR).exists()


def test_importing_phase_timer_does_not_import_transformers():
    code = "import sys, phase_timer; assert 'transformers' not in sys.modules, 'imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_training_step_the_user_put_on_the_instance_is_timed_and_kept(tmp_path):
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    t = trainer(tmp_path, cb, steps=12)
    calls = []
    original = t.training_step

    def training_step(*args, **kwargs):  # the user's own patch, on the instance
        calls.append(1)
        return original(*args, **kwargs)

    t.training_step = training_step
    t.train()
    assert len(calls) == 12 and cb.timer.totals.steps == 10
    assert t.__dict__["training_step"] is training_step  # theirs again, not ours, not gone


# `gradient_checkpointing=` is the name every supported transformers (>= 4.50) knows; v5 also takes
# `activation_checkpointing=` and says the old name is deprecated.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_gradient_checkpointing_a_compiled_model_and_clipping_are_timed(tmp_path):
    """gradient_checkpointing (the forward recomputed inside backward), torch_compile (the loop calls the
    compiled module: dynamo's eager backend here, inductor on the GPU) and max_grad_norm, together."""
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    t = trainer(tmp_path, cb, steps=12, gradient_checkpointing=True, torch_compile=True,
                torch_compile_backend="eager", max_grad_norm=0.5)
    t.train()
    totals = cb.timer.totals
    assert totals.steps == 10 and isinstance(t.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert all(totals.phases[p].min > 0 for p in ("forward", "backward", "optimizer", "between_steps"))
    assert totals.phases["step"].total == pytest.approx(sum(totals.phases[p].total for p in ("forward", "backward", "optimizer")))


def test_checkpoints_are_in_no_phase_and_a_resumed_run_continues_at_the_trainers_step(tmp_path, monkeypatch):
    """save_strategy="steps": the checkpoint's save is paused; resume_from_checkpoint: the resumed
    train() logs at the Trainer's own steps after the checkpoint, each once."""
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    t = trainer(tmp_path / "run", cb, steps=20, save_strategy="steps", save_steps=10, report_to="tensorboard")
    t.train()
    assert cb.timer.totals.steps == 18
    assert os.path.isdir(tmp_path / "run" / "checkpoint-10")

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb2"))
    cb2 = PhaseTimerCallback(warmup_steps=2, summary=False)
    t2 = trainer(tmp_path / "run", cb2, steps=20, save_strategy="no", report_to="tensorboard")
    t2.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    assert cb2.timer.totals.steps == 8  # steps 11..20, 2 warm-up
    logged = [s for s, _ in read_scalars(cb2.timer.log_dir)["phase_time/step_ms/mean"]]
    assert logged == [20]  # the window of logging_steps=10 that ends at the Trainer's step 20, once


def test_a_save_is_paused_not_between_steps(tmp_path, host_hours):
    """A slow checkpoint save (an hour of the host clock inside the model's save) is in no phase and not in
    period: the timer is paused all through it, and no step's value holds that hour, however loaded the machine."""
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    t = trainer(tmp_path, cb, steps=12, save_strategy="steps", save_steps=3)
    save = t._save
    paused = []

    def slow_save(*args, **kwargs):
        paused.append(cb._bounds.paused)
        host_hours.jump()
        return save(*args, **kwargs)

    t._save = slow_save
    t.train()
    totals = cb.timer.totals
    assert totals.steps == 10 and paused == [True] * 4  # the saves at steps 3, 6, 9 and 12, each while paused
    assert {p: hours(v.max) for p, v in totals.phases.items()} == dict.fromkeys(totals.phases, 0)


def test_a_callback_that_cannot_attach_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    import phase_timer.doors.hf_trainer as door

    def broken(*args, **kwargs):
        raise RuntimeError("an unforeseen Trainer")

    monkeypatch.setattr(door, "LoopTimer", broken)
    cb = PhaseTimerCallback(warmup_steps=2, summary=False)
    t = trainer(tmp_path, cb, steps=6)
    with pytest.warns(RuntimeWarning, match="could not attach to this Trainer .*unforeseen Trainer"):
        out = t.train()
    assert out.global_step == 6 and cb.timer is None
    assert "get_batch_samples" not in t.__dict__ and "training_step" not in t.__dict__
