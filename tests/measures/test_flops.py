"""FLOPs per phase, the peak table and MFU (issue 37, part 2), on the CPU.

What FlopCounterMode sees on each kind of model is written up, with these figures, in docs/flops.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from phase_timer.measures.flops import (
    COUNTED,
    GIVEN,
    FlopCounter,
    StepFlops,
    check_flops_arg,
    check_peak_arg,
    gpt2_flops_per_token,
)
from phase_timer.measures.mfu import format_mfu, format_no_flops, format_no_peak, mfu, mfu_advice, step_mfu
from phase_timer.measures.peaks import Peak, peak_tflops, precision_key, tf32_allowed
from phase_timer.signature import signature

M = 8  # rows of the batch
WIDTHS = (16, 32, 32, 4)  # a stack of three Linear layers: 16 -> 32 -> 32 -> 4


def _stack(bias: bool) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for n_in, n_out in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(n_in, n_out, bias=bias), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _count_step(model: torch.nn.Module, x: torch.Tensor, counter: FlopCounter | None = None) -> StepFlops | None:
    """One training step as a door sees it: start at the forward, a mark at backward's call and return."""
    counter = counter or FlopCounter()
    assert counter.start(signature(x), "forward")
    loss = model(x).sum()
    counter.mark("backward")
    loss.backward()
    counter.mark("optimizer")
    return counter.stop()


# --- exact counts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_grad", [False, True])
def test_a_linear_stack_counts_2mnk_a_matmul_forward_and_twice_that_backward(bias, input_grad):
    """Forward: 2*m*n*k per Linear (a bias makes it addmm: the same count, its add is not a matmul).
    Backward: the weights' gradient and the input's, 2*m*n*k each -- except the first layer's input
    gradient when the batch does not require grad: autograd does not compute it, so backward is twice
    forward less that one matmul."""
    x = torch.randn(M, WIDTHS[0], requires_grad=input_grad)
    counts = _count_step(_stack(bias), x)
    forward = sum(2 * M * n_in * n_out for n_in, n_out in zip(WIDTHS, WIDTHS[1:]))
    first_dgrad = 0 if input_grad else 2 * M * WIDTHS[0] * WIDTHS[1]
    assert counts.source == COUNTED
    assert counts.phases == {"forward": forward, "backward": 2 * forward - first_dgrad, "optimizer": 0}
    assert counts.recompute == 0 and counts.model_total == counts.hardware_total == 3 * forward - first_dgrad


def test_micro_batches_of_one_step_add_up_in_their_phases():
    model, x = _stack(True), torch.randn(M, WIDTHS[0], requires_grad=True)
    one = _count_step(model, x)
    counter = FlopCounter()
    counter.start(signature(x), "forward")
    for i in range(3):  # gradient accumulation: forward, backward, forward, backward ...
        loss = model(x).sum()
        counter.mark("backward")
        loss.backward()
        counter.mark("idle" if i < 2 else "optimizer")
        if i < 2:
            counter.mark("forward")
    counts = counter.stop()
    assert counts.forward == 3 * one.forward and counts.backward == 3 * one.backward


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recompute_is_backwards_and_left_out_of_the_model_flops(reentrant):
    """Recompute runs inside backward, so FlopCounterMode counts it there (hardware FLOPs).  Reentrant
    checkpointing reruns each block's whole forward; non-reentrant stops once the saved tensors it
    needs are back (here: the first Linear of each block).  The model's FLOPs stay 3x forward."""
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
                                 for _ in range(3))
    x = torch.randn(M, 32, requires_grad=True)
    counter = FlopCounter()
    counter.start(signature(x))
    h = x
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=reentrant)
    counter.mark("backward")
    h.sum().backward()
    counts = counter.stop()
    fwd = 3 * 2 * (2 * M * 32 * 32)
    assert counts.forward == fwd
    recomputed = fwd if reentrant else fwd // 2
    assert counts.backward == 2 * fwd + recomputed
    assert counts.recompute == recomputed and counts.model_total == 3 * fwd


def test_a_compiled_model_is_counted_eagerly_and_runs_compiled_again_after():
    """Under a dispatch mode Dynamo runs a frame eagerly and (torch <= 2.13) marks its code skipped for
    good.  The counted step runs under set_stance("force_eager"): the eager ops are counted, and the
    compiled graph runs on the next steps."""
    runs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        def compiled(*args):
            runs.append(1)
            return gm.forward(*args)

        return compiled

    torch._dynamo.reset()
    model = torch.compile(_stack(True), backend=backend)
    x = torch.randn(M, WIDTHS[0], requires_grad=True)
    model(x).sum().backward()
    assert len(runs) == 1
    counts = _count_step(model, x)
    assert counts.forward == sum(2 * M * a * b for a, b in zip(WIDTHS, WIDTHS[1:]))
    assert len(runs) == 1  # the counted step ran eagerly
    model(x).sum().backward()
    model(x).sum().backward()
    assert len(runs) == 3


# --- never break training --------------------------------------------------------------------------------


@torch.library.custom_op("phase_timer_test::opaque_mm", mutates_args=())
def _opaque_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def test_a_step_of_kernels_it_has_no_formula_for_gives_no_count_and_says_pass_flops_per_step():
    counter = FlopCounter()
    counter.start(("x",))
    _opaque_mm(torch.randn(4, 4), torch.randn(4, 4))  # a custom op (Transformer Engine's, a Triton kernel's kind)
    with pytest.warns(RuntimeWarning, match="counted no FLOPs.*flops_per_step="):
        assert counter.stop() is None
    assert counter.failed and not counter.wants(("y",))


def test_a_formula_that_raises_does_not_reach_the_training_step(monkeypatch):
    from torch.utils import flop_counter

    def broken(*args, **kwargs):
        raise AssertionError("an unexpected shape")

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, broken)
    model, x = _stack(False), torch.randn(M, WIDTHS[0], requires_grad=True)
    with pytest.warns(RuntimeWarning, match="a FLOP formula failed.*an unexpected shape"):
        assert _count_step(model, x) is None
    assert all(p.grad is not None for p in model.parameters())  # the step itself went through


def test_close_after_a_failed_step_leaves_no_mode_and_the_compile_stance_and_warnings_as_they_were():
    from torch._dynamo import eval_frame

    filters = list(warnings.filters)
    counter = FlopCounter()
    counter.start(("x",))
    assert torch._C._len_torch_dispatch_stack() == 1 and eval_frame._stance.stance == "force_eager"
    counter.close()  # the door's exception path
    assert torch._C._len_torch_dispatch_stack() == 0 and eval_frame._stance.stance == "default"
    assert warnings.filters == filters
    assert not counter.counting and counter.stop() is None


def test_a_mode_entered_during_the_step_and_still_on_is_left_first():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Theirs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    counter, theirs = FlopCounter(), Theirs()
    x = torch.randn(M, WIDTHS[0])
    counter.start(signature(x))
    theirs.__enter__()
    _stack(False)(x)
    with pytest.warns(RuntimeWarning, match="still on at its end"):
        counts = counter.stop()
    assert counts.forward > 0  # the count is good; only the leaving waits
    assert torch._C._len_torch_dispatch_stack() == 2
    theirs.__exit__(None, None, None)
    assert not counter.wants(signature(x))  # ... and it leaves at the door's next call
    assert torch._C._len_torch_dispatch_stack() == 0


# --- shapes -------------------------------------------------------------------------------------------------


def test_the_signature_is_the_shapes_never_the_values():
    a = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.ones(4, 16)}
    b = {"input_ids": torch.full((4, 16), 7), "labels": torch.randn(4, 16)}
    assert signature(a) == signature(b)
    assert signature(a) != signature({**a, "labels": torch.ones(4, 17)})
    assert signature((torch.zeros(2, 3), torch.zeros(2))) != signature((torch.zeros(2, 3), torch.zeros(3)))
    nested = {"x": [torch.zeros(2), {"y": torch.zeros(3)}], "n": 5}
    assert signature(nested) == ("x", 2, (2,), "y", (3,), "n", "int")


def test_a_new_shape_is_counted_again_and_a_seen_one_is_not():
    model, counter = _stack(True), FlopCounter()
    short, long_ = torch.randn(M, WIDTHS[0]), torch.randn(2 * M, WIDTHS[0])
    assert counter.wants(signature(short)) and counter.known(signature(short)) is None
    first = _count_step(model, short, counter)
    assert not counter.wants(signature(short)) and counter.known(signature(short)) is first
    assert counter.wants(signature(long_))
    second = _count_step(model, long_, counter)
    assert second.forward == 2 * first.forward
    assert counter.known(signature(long_)) is second and counter.known(signature(short)) is first


def test_after_max_shapes_a_new_shape_is_not_counted_and_it_is_said_once():
    counter = FlopCounter(max_shapes=2)
    model = _stack(False)
    for rows in (1, 2):
        _count_step(model, torch.randn(rows, WIDTHS[0]), counter)
    with pytest.warns(RuntimeWarning, match="more than 2 shapes"):
        assert not counter.wants(signature(torch.randn(3, WIDTHS[0])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not counter.wants(signature(torch.randn(4, WIDTHS[0])))
    assert len(counter.uncounted) == 2


# --- flops_per_step= and peak_tflops= -------------------------------------------------------------------------


def test_a_given_count_is_used_for_every_shape_and_nothing_is_counted():
    given = check_flops_arg("PhaseTimer", 3e12)
    assert given.source == GIVEN and given.hardware_total == given.model_total == 3e12 and given.phases == {}
    counter = FlopCounter(given=given)
    assert not counter.wants(("any",)) and counter.known(("any",)) is given
    split = check_flops_arg("PhaseTimer", {"forward": 1e12, "backward": 2e12})
    assert split.forward == 1e12 and split.backward == 2e12 and split.model_total == 3e12


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "1e12", {}, {"forward": 1e12},
                                 {"forward": 1e12, "backward": 0}, {"forward": 1, "backward": 2, 3: 4}, [1, 2]])
def test_a_bad_flops_per_step_fails_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"^PhaseTimer\(flops_per_step=.*\): `flops_per_step` must be FLOPs per step"):
        check_flops_arg("PhaseTimer", bad)


@pytest.mark.parametrize("bad", [0, -5.0, "989", True, float("nan")])
def test_a_bad_peak_tflops_fails_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"^PhaseTimer\(peak_tflops=.*\): `peak_tflops` must be the device's dense"):
        check_peak_arg("PhaseTimer", bad)
    assert check_peak_arg("PhaseTimer", 312) == 312.0 and check_peak_arg("PhaseTimer", None) is None


# --- the peak table ---------------------------------------------------------------------------------------


# (name as torch.cuda.get_device_name() gives it, device matched, bf16, fp16, tf32 key's peak, fp32, fp8)
DEVICES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 989.4, 494.7, 66.9, 1978.9),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 756.5, 378.0, 51.0, 1513.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 835.5, 417.5, 60.0, 1670.5),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312.0, 312.0, 156.0, 19.5, None),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312.0, 312.0, 156.0, 19.5, None),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0, 312.0, 156.0, 19.5, None),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312.0, 312.0, 156.0, 19.5, None),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", None, 125.0, 15.7, 15.7, None),  # no TF32: fp32's peak
    ("Tesla V100-PCIE-32GB", "V100 PCIe", None, 112.0, 14.0, 14.0, None),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe", None, 130.0, 16.4, 16.4, None),
    ("Tesla T4", "T4", None, 65.0, 8.1, 8.1, None),
    ("NVIDIA A10", "A10", 125.0, 125.0, 62.5, 31.2, None),
    ("NVIDIA L4", "L4", 121.0, 121.0, 60.0, 30.3, 242.5),
    ("NVIDIA L40S", "L40S", 362.05, 362.05, 183.0, 91.6, 733.0),
    ("NVIDIA H200", "H200 SXM", 989.4, 989.4, 494.7, 66.9, 1978.9),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 835.5, 417.5, 60.0, 1670.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4, 989.4, 494.7, 66.9, 1978.9),
    ("NVIDIA B200", "B200", 2250.0, 2250.0, 1125.0, 75.0, 4500.0),
    ("NVIDIA GB200", "GB200", 2500.0, 2500.0, 1250.0, 80.0, 5000.0),
    ("AMD Instinct MI300X", "MI300X", 1307.4, 1307.4, 163.4, 163.4, 2614.9),  # TF32 not mapped on ROCm
    ("AMD Instinct MI300X VF", "MI300X", 1307.4, 1307.4, 163.4, 163.4, 2614.9),
    ("AMD Instinct MI325X", "MI325X", 1307.4, 1307.4, 163.4, 163.4, 2614.9),
    ("AMD Instinct MI250X", "MI250X (one GCD)", 191.5, 191.5, 47.85, 47.85, None),
    ("AMD Instinct MI250", "MI250 (one GCD)", 181.05, 181.05, 45.25, 45.25, None),
]


@pytest.mark.parametrize(("name", "device", "bf16", "fp16", "tf32", "fp32", "fp8"), DEVICES)
def test_the_peak_of_each_device_name_and_precision(name, device, bf16, fp16, tf32, fp32, fp8):
    for key, want in (("bf16", bf16), ("fp16", fp16), ("tf32", tf32), ("fp32", fp32), ("fp8", fp8)):
        peak = peak_tflops(name, key)
        if want is None:
            assert peak is None, (name, key)
            continue
        assert (peak.device, peak.tflops) == (device, want), (name, key)
        assert peak.source  # every figure says where it comes from
    assert peak_tflops(name, "fp8") is None or "fp8 peak" in peak_tflops(name, "fp8").note


@pytest.mark.parametrize("name", ["NVIDIA H100", "NVIDIA L40", "NVIDIA A10G", "NVIDIA GeForce RTX 4090",
                                  "AMD Instinct MI300A", "AMD Instinct MI250X/MI250", "cpu", ""])
def test_an_unknown_or_ambiguous_device_has_no_peak(name):
    assert all(peak_tflops(name, key) is None for key in ("bf16", "fp16", "tf32", "fp32", "fp8"))


def test_rocm_s_shared_mi250_name_is_told_apart_by_compute_units():
    assert peak_tflops("AMD Instinct MI250X/MI250", "bf16", compute_units=110).tflops == 191.5
    assert peak_tflops("AMD Instinct MI250X/MI250", "bf16", compute_units=104).tflops == 181.05
    assert peak_tflops("AMD Instinct MI250X/MI250", "bf16", compute_units=80) is None


@pytest.mark.parametrize(("precision", "tf32", "key"), [
    ("bf16-mixed", False, "bf16"), ("bf16-true", False, "bf16"), ("bf16", False, "bf16"),
    ("16-mixed", False, "fp16"), ("16-true", False, "fp16"), ("16", False, "fp16"),
    ("32-true", False, "fp32"), ("32-true", True, "tf32"), ("32", True, "tf32"), ("fp32", False, "fp32"),
    ("transformer-engine", False, "fp8"), ("transformer-engine-float16", False, "fp8"),
    ("64-true", False, None), (None, True, None),
])
def test_the_runs_precision_string_gives_the_tables_key(precision, tf32, key):
    assert precision_key(precision, tf32=tf32) == key


def test_tf32_allowed_follows_the_float32_matmul_precision():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not tf32_allowed()
        torch.set_float32_matmul_precision("high")
        assert tf32_allowed()
    finally:
        torch.set_float32_matmul_precision(before)


# --- MFU ------------------------------------------------------------------------------------------------------


def test_mfu_is_absent_without_a_peak_and_present_with_peak_tflops():
    assert mfu(1e12, 10.0, peak_tflops("NVIDIA GeForce RTX 4090", "bf16")) is None
    assert mfu(1e12, 10.0, None) is None and mfu(None, 10.0, 100.0) is None and mfu(1e12, 0.0, 100.0) is None
    assert mfu(1e12, 10.0, check_peak_arg("PhaseTimer", 200)) == pytest.approx(0.5)  # 1e12 in 10 ms of 200 TFLOP/s


def test_step_mfu_is_the_model_flops_over_period_and_each_phases_flops_over_its_time():
    peak = peak_tflops("NVIDIA A100-SXM4-80GB", "bf16")  # 312 TFLOP/s: 3.12e9 FLOPs a microsecond ... per ms 3.12e11
    flops = StepFlops({"forward": 3.12e11, "backward": 7.8e11, "optimizer": 0.0}, COUNTED)  # 1.56e11 recomputed
    head, phases = step_mfu(flops, 10.0, {"forward": 2.0, "backward": 5.0, "optimizer": 1.0}, peak)
    assert head == pytest.approx(3 * 3.12e11 / 3.12e12)
    assert phases == {"forward": pytest.approx(0.5), "backward": pytest.approx(0.5)}


def test_the_table_line_prints_the_denominator_beside_the_ratio():
    peak = peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    counted = StepFlops({"forward": 1.0, "backward": 2.0}, COUNTED)
    line = format_mfu(0.41, {"forward": 0.52, "backward": 0.47}, peak, counted)
    assert line == "MFU 41% of 989 TFLOP/s (bf16 dense, H100 SXM): forward 52%, backward 47%"
    given = check_flops_arg("PhaseTimer", 1e15)
    assert format_mfu(0.3, {}, 500.0, given) == "MFU 30% of 500 TFLOP/s (peak_tflops=); FLOPs given (flops_per_step=)"
    recomputed = StepFlops({"forward": 1.0, "backward": 3.0}, COUNTED)
    assert "backward's count has 33% recompute" in format_mfu(0.3, {}, peak, recomputed)
    assert "fp8 peak" in format_mfu(0.3, {}, peak_tflops("NVIDIA H100 80GB HBM3", "fp8"))


def test_the_unknown_device_and_no_flops_lines():
    assert format_no_peak("NVIDIA GeForce RTX 4090", "bf16") == \
        'MFU: no peak known for "NVIDIA GeForce RTX 4090" (bf16): pass peak_tflops='
    assert format_no_flops() == "MFU: no FLOPs counted: pass flops_per_step="


def test_advice_says_an_mfu_over_100_percent_is_a_wrong_count_or_peak_and_nothing_else():
    tips = mfu_advice(1.3, {"forward": 1.5, "backward": 1.2}, gpu_bound=True, precision="bf16")
    assert len(tips) == 1 and "step 130%" in tips[0] and "the FLOP count or the peak is wrong" in tips[0]


def test_advice_for_a_gpu_bound_run_at_low_mfu_names_the_far_phase_and_the_usual_lifts():
    tips = mfu_advice(0.12, {"forward": 0.35, "backward": 0.08}, gpu_bound=True, precision="fp32",
                      optimizer_share=0.25)
    text = "\n".join(tips)
    assert "backward runs at 8% of the peak" in text and "forward runs" not in text
    assert "bf16 autocast" in text and "TF32" in text
    assert "larger matmuls" in text and "torch.compile" in text and "fused optimizer" in text
    assert "TF32 (torch" not in "\n".join(mfu_advice(0.12, {}, gpu_bound=True, precision="tf32"))  # already on
    assert mfu_advice(0.12, {"forward": 0.1}, gpu_bound=False, precision="fp32") == []
    assert mfu_advice(0.45, {"forward": 0.5}, gpu_bound=True, precision="bf16") == []


# --- the analytic GPT-2 count --------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2s_analytic_count_is_what_flop_counter_mode_counts_less_what_the_cpus_fused_attention_hides(attn):
    """6N + 12*L*d*T a token, N the weights of the matmuls (the tied LM head included): exact with eager
    attention.  With SDPA on the CPU (no dropout) the fused kernel has no formula: the count lacks
    exactly attention's 12*L*d*T a token (on CUDA, flash/efficient/cuDNN SDPA are counted)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=64,
                                     attn_pdrop=0.0, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    batch, seq = 2, 32
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    counter = FlopCounter()
    counter.start(signature(ids))
    loss = model(input_ids=ids, labels=ids).loss
    counter.mark("backward")
    loss.backward()
    counts = counter.stop()
    analytic = gpt2_flops_per_token(config, seq) * batch * seq
    attention = 12 * config.n_layer * config.n_embd * seq * batch * seq
    assert counts.backward == 2 * counts.forward
    assert counts.hardware_total == (analytic if attn == "eager" else analytic - attention)
