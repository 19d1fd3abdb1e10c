"""FLOPs and MFU through every door (CPU): which step is counted and left untimed, what a timed step carries,
MFU's arithmetic against the run's own period, the arguments, and the verdict's lines."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.measures.flops import gpt2_flops_per_token

B, D_IN, D_H, D_OUT = 6, 24, 40, 8
#: An MLP's FLOPs a step, as FlopCounterMode counts them: forward 2*B*(in*h + h*out); backward the weights'
#: gradients (the same) and the second layer's input gradient (the first layer's input needs none).
FWD = 2 * B * (D_IN * D_H + D_H * D_OUT)
BWD = FWD + 2 * B * D_H * D_OUT


def _mlp_loop(tmp_path, batches, *, warmup_steps=2, window=10, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with phase_timer.attach(model, opt, batches, log_dir=tmp_path, warmup_steps=warmup_steps, window=window,
                            summary=False, **kw) as timer:
        for x, y in timer.loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return timer


def _batches(n, b=B):
    return [(torch.randn(b, D_IN), torch.randint(0, D_OUT, (b,))) for _ in range(n)]


def _summary(timer):
    with open(timer.summary_path) as f:
        return json.load(f)


def test_a_plain_loop_counts_its_flops_once_on_a_warm_up_step_and_every_timed_step_carries_them(tmp_path):
    from tests.helpers import read_scalars

    timer = _mlp_loop(tmp_path, _batches(40), peak_tflops=0.01)
    data = _summary(timer)
    assert data["steps"]["timed"] == 38  # the count took a warm-up step, not a timed one
    fl = data["flops"]
    assert fl["source"] == "counted" and fl["per_step"] == {"forward": FWD, "backward": BWD, "hardware": FWD + BWD,
                                                           "model": FWD + BWD}
    period_ms = data["phases"]["period"]["total_ms"]
    assert fl["tflops_per_s"] == pytest.approx((FWD + BWD) * 38 / (period_ms / 1e3) / 1e12, rel=1e-9)
    assert fl["mfu"]["step"] == pytest.approx(fl["tflops_per_s"] / 0.01, rel=1e-9)
    fwd_ms = data["phases"]["forward"]["total_ms"]
    assert fl["mfu"]["forward"] == pytest.approx(FWD * 38 / (fwd_ms / 1e3) / 0.01e12, rel=1e-9)
    assert fl["peak"] == {"tflops": 0.01, "precision": None, "device": None, "source": "peak_tflops="}
    scalars = read_scalars(timer.log_dir)
    assert [s for s, _ in scalars["throughput/mfu"]] == [9, 19, 29, 39]
    assert {"throughput/tflops_per_s", "throughput/mfu_forward", "throughput/mfu_backward"} <= set(scalars)
    assert not any(tag.startswith("phase_time/flops") for tag in scalars)  # counts, never phases
    assert "flops" not in timer.totals.phases
    assert "MFU " in timer.last_summary and "of 0.01 TFLOP/s (peak_tflops=)" in timer.last_summary


def test_with_no_warm_up_the_counted_step_goes_untimed_and_the_next_period_is_its_own(tmp_path, host_hours):
    timer = _mlp_loop(tmp_path, _batches(30), warmup_steps=0, peak_tflops=0.01)
    data = _summary(timer)
    assert data["steps"]["timed"] == 29  # 30 steps, the counted one dropped
    assert data["flops"]["per_step"]["hardware"] == FWD + BWD


@pytest.mark.parametrize("every_step_sampled", [False, True])
def test_a_new_shape_is_counted_on_its_first_step_and_each_step_carries_its_own_count(tmp_path, monkeypatch,
                                                                                      every_step_sampled):
    if every_step_sampled:  # the new shape's first step is a verdict's sampled step: it gives up its sample
        monkeypatch.setattr("phase_timer.run.boundaries.sample_gap", lambda rng, n: 1)
    small, large = _batches(20, b=B), _batches(20, b=2 * B)
    timer = _mlp_loop(tmp_path, small + large, peak_tflops=0.01)
    data = _summary(timer)
    assert data["steps"]["timed"] == 37  # 2 warm-up steps, and the larger shape's first step counted
    # 18 small steps and 19 large ones were timed: each carried its own shape's FLOPs
    assert data["flops"]["per_step"]["hardware"] == pytest.approx((18 * (FWD + BWD) + 19 * 2 * (FWD + BWD)) / 37)


def test_given_flops_are_used_as_given_and_no_step_is_counted(tmp_path):
    timer = _mlp_loop(tmp_path, _batches(30), warmup_steps=0, flops_per_step={"forward": 1e6, "backward": 2e6},
                      peak_tflops=0.01)
    data = _summary(timer)
    fl = data["flops"]
    assert data["steps"]["timed"] == 30 and fl["source"] == "given"
    assert fl["per_step"] == {"forward": 1e6, "backward": 2e6, "hardware": 3e6, "model": 3e6}
    assert "FLOPs given (flops_per_step=)" in timer.last_summary
    timer = _mlp_loop(tmp_path / "total", _batches(30), flops_per_step=5e6, peak_tflops=0.01)
    fl = _summary(timer)["flops"]
    assert fl["per_step"] == {"forward": None, "backward": None, "hardware": 5e6, "model": 5e6}
    assert fl["mfu"]["forward"] is None and fl["mfu"]["step"] > 0


def test_on_the_host_without_a_peak_nothing_is_counted_and_mfu_false_turns_it_off(tmp_path):
    timer = _mlp_loop(tmp_path / "a", _batches(30), warmup_steps=0)
    assert _summary(timer)["flops"] is None and timer.totals.steps == 30  # no step given up to a count
    timer = _mlp_loop(tmp_path / "b", _batches(30), warmup_steps=0, peak_tflops=1.0, mfu=False)
    assert _summary(timer)["flops"] is None and timer.totals.steps == 30
    assert "MFU" not in timer.last_summary


def test_recompute_is_in_backwards_count_but_not_in_the_models_flops(tmp_path):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with phase_timer.attach(model, opt, _batches(25), log_dir=tmp_path, warmup_steps=2, summary=False,
                            peak_tflops=0.01) as timer:
        for x, y in timer.loader:
            # the input needs its gradient too: backward is then twice forward, and recompute is what is beyond
            nn.functional.cross_entropy(model(x.requires_grad_()), y).backward()
            opt.step()
            opt.zero_grad()
    per = _summary(timer)["flops"]["per_step"]
    first_layer = 2 * B * D_IN * D_H  # recomputed inside backward (the last layer's output is not needed again)
    assert per["forward"] == FWD and per["backward"] == 2 * FWD + first_layer
    assert per["hardware"] == 3 * FWD + first_layer and per["model"] == 3 * FWD
    assert "recompute" in timer.last_summary


@pytest.mark.parametrize("kw, arg", [
    ({"flops_per_step": -1}, "flops_per_step"),
    ({"flops_per_step": {"forward": 1e9}}, "flops_per_step"),
    ({"flops_per_step": {"forward": 1e9, "backward": "2e9"}}, "flops_per_step"),
    ({"peak_tflops": 0}, "peak_tflops"),
    ({"peak_tflops": float("inf")}, "peak_tflops"),
    ({"mfu": "yes"}, "mfu"),
])
def test_bad_flop_arguments_fail_at_construction_naming_the_argument_in_every_door(tmp_path, kw, arg):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=rf"attach\({arg}=.*`{arg}`"):
        phase_timer.attach(model, torch.optim.SGD(model.parameters(), 0.1), [], log_dir=tmp_path, **kw)
    with pytest.raises(ValueError, match=rf"PhaseTimer\({arg}=.*`{arg}`"):
        phase_timer.PhaseTimer(**kw)
    with pytest.raises(ValueError, match=rf"PhaseTimerCallback\({arg}=.*`{arg}`"):
        phase_timer.PhaseTimerCallback(**kw)


def test_lightning_counts_its_step_with_accumulation(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tests.helpers import loader, module_class

    timer = phase_timer.PhaseTimer(warmup_steps=2, summary=False, log_dir=tmp_path, peak_tflops=0.01)
    pl.Trainer(max_steps=22, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, accumulate_grad_batches=2,
               callbacks=[timer]).fit(module_class("lightning.pytorch")(), loader(batch_size=8))
    data = _summary(timer)
    fwd = 2 * 8 * (16 * 32 + 32 * 1)  # the Sleepy module's two Linear layers, a micro-batch of 8
    assert data["steps"]["timed"] == 20
    assert data["flops"]["per_step"]["forward"] == 2 * fwd  # both micro-batches of the step
    assert data["flops"]["per_step"]["backward"] == 2 * (fwd + 2 * 8 * 32)
    assert data["flops"]["mfu"]["step"] > 0


def test_the_hf_trainer_counts_a_gpt2_step_as_6n_plus_attention(tmp_path):
    pytest.importorskip("transformers")
    from tests.doors.test_hf_trainer import trainer as hf_trainer

    cb = phase_timer.PhaseTimerCallback(warmup_steps=2, summary=False, peak_tflops=0.01)
    t = hf_trainer(tmp_path, cb, steps=14, gradient_accumulation_steps=2)
    t.model.config._attn_implementation = "eager"  # CPU SDPA has no FLOP formula: eager attention's matmuls have
    t.train()
    data = _summary(cb)
    tokens = 4 * 16 * 2  # 4 samples of 16 tokens a micro-batch, two micro-batches a step
    expected = gpt2_flops_per_token(t.model.config, 16) * tokens
    assert data["flops"]["per_step"]["model"] == expected
    assert data["flops"]["per_step"]["backward"] == 2 * data["flops"]["per_step"]["forward"]
    assert data["steps"]["timed"] == 12 and data["flops"]["mfu"]["step"] > 0


def test_mfu_over_100_percent_is_said_to_be_wrong(tmp_path):
    timer = _mlp_loop(tmp_path, _batches(30), flops_per_step=1e15, peak_tflops=0.001)
    kinds = [timer.diagnosis.kind, *(d.kind for d in timer.diagnosis.secondary)]
    assert "MFU_IMPOSSIBLE" in kinds
    finding = next(d for d in (timer.diagnosis, *timer.diagnosis.secondary) if d.kind == "MFU_IMPOSSIBLE")
    assert "flops_per_step= too high" in finding.next[0]


def test_without_a_loader_the_first_forwards_inputs_say_the_steps_flops(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with phase_timer.attach(model, opt, log_dir=tmp_path, warmup_steps=2, summary=False, peak_tflops=0.01) as timer:
        for x, y in _batches(25):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    data = _summary(timer)
    assert data["flops"]["per_step"]["hardware"] == FWD + BWD
    assert data["throughput"]["per_step"]["samples"] == 6  # the forward's inputs are the step's batch


class _OddShape:
    shape = [3, 4]  # a list: no signature can hold it


def test_a_batch_whose_shape_cannot_be_a_signature_warns_once_and_training_goes_on(tmp_path):
    batches = [(x, y, _OddShape()) for x, y in _batches(25)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with pytest.warns(RuntimeWarning, match="shapes cannot be read") as said:
        with phase_timer.attach(model, opt, batches, log_dir=tmp_path, warmup_steps=2, summary=False,
                                peak_tflops=0.01) as timer:
            for x, y, _ in timer.loader:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert len([w for w in said if "shapes cannot be read" in str(w.message)]) == 1
    assert timer.totals.steps == 23 and _summary(timer)["flops"] is None
