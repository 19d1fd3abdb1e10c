"""The 🤗 door on a GPU: its overhead on a GPU-bound Trainer, and the Trainer's own syncs by setting.

    PYTHONPATH=. python benchmarks/hf_trainer.py [--only overhead,syncs] [--pairs 7] [--steps 60] [--out FILE]

``overhead``: a ``transformers.Trainer`` on a GPT-2-small-sized model from a config (bf16, 16 x 1024
tokens a step: GPU-bound), ``train()`` without and with ``PhaseTimerCallback``, interleaved (A B A B
...); each run's time per step is the host's time from the end of step 10 to the end of its last
step (a callback's ``on_step_end``, listed first); the overhead is the median of the per-pair ratios.

``syncs``: the same model at 8 x 512 tokens, one short ``train()`` per setting; per step, the
runtime API's ``cudaStreamSynchronize`` calls the profiler records over steps 8-14 (no timer),
and what the sync census of ``PhaseTimerCallback`` names on its warm-up step (another run):
which of the Trainer's settings causes which sync, and what is left when they are off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.models import Tokens  # noqa: E402

LINES: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def _trainer(steps: int, batch: int, seq: int, callbacks: list[Any], mask: bool = False, **kw: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=seq))
    kw.setdefault("bf16", True)
    kw.setdefault("logging_steps", 10)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=steps,
                             report_to="none", save_strategy="no", disable_tqdm=True, **kw)
    return Trainer(model=model, args=args, train_dataset=Tokens(batch * steps, seq, mask=mask), callbacks=callbacks)


# -- overhead ---------------------------------------------------------------------------------------
def _clocked(steps: int, timed: bool) -> float:
    """ms per step over steps 11..steps of one train(), with or without the callback."""
    from transformers import TrainerCallback

    ends: dict[int, int] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends[state.global_step] = time.perf_counter_ns()

    callbacks: list[Any] = [Clock()]
    if timed:
        callbacks.append(phase_timer.PhaseTimerCallback(summary=False, log_dir=tempfile.mkdtemp()))
    _trainer(steps, 16, 1024, callbacks).train()
    return (ends[steps] - ends[10]) / 1e6 / (steps - 10)


def overhead(pairs: int, steps: int) -> None:
    _clocked(20, False)  # warm: kernels, allocator, cuBLAS
    ratios, base = [], []
    for _ in range(pairs):
        a = _clocked(steps, False)
        b = _clocked(steps, True)
        ratios.append(b / a)
        base.append(a)
    med = 100 * (statistics.median(ratios) - 1)
    q = statistics.quantiles([100 * (r - 1) for r in ratios], n=4) if len(ratios) >= 2 else [med, med, med]
    say(f"overhead  transformers.Trainer  GPT-2-small 16x1024 bf16  {med:+.2f}% (median of {pairs} pairs; IQR "
        f"{q[0]:+.2f}..{q[2]:+.2f}%; each {[f'{100 * (r - 1):+.2f}' for r in ratios]}), step "
        f"{statistics.median(base):.2f} ms without")


# -- the Trainer's own syncs ------------------------------------------------------------------------
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults (bf16)": {},
    "logging_nan_inf_filter=False": {"logging_nan_inf_filter": False},
    "+ max_grad_norm=0": {"logging_nan_inf_filter": False, "max_grad_norm": 0.0},
    "defaults, fp16": {"bf16": False, "fp16": True},
    "fp16, logging_nan_inf_filter=False": {"bf16": False, "fp16": True, "logging_nan_inf_filter": False},
    "include_num_input_tokens_seen='all'": {"include_num_input_tokens_seen": "all"},
    "logging_steps=1": {"logging_steps": 1},
    "accelerator_config={'non_blocking': True}": {"accelerator_config": {"non_blocking": True}},
    "all off: nan filter, non_blocking": {"logging_nan_inf_filter": False, "accelerator_config": {"non_blocking": True}},
    "all off, and an attention_mask in the batch": {"logging_nan_inf_filter": False,
                                                     "accelerator_config": {"non_blocking": True}, "mask": True},
}


def _profiled_syncs(kw: dict[str, Any], first: int = 8, last: int = 14) -> float:
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    class Window(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            if state.global_step == first:
                prof.__enter__()

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            if state.global_step == last:
                prof.__exit__(None, None, None)

    _trainer(last + 2, 8, 512, [Window()], **kw).train()
    return sum(e.name == "cudaStreamSynchronize" for e in prof.events()) / (last - first)


def syncs() -> None:
    say("the Trainer's syncs by setting (GPT-2-small 8x512): cudaStreamSynchronize a step (profiler, steps 8-14, "
        "no timer) | the census (PhaseTimerCallback, warm-up step 5): phase, count, where, cause")
    for name, kw in SETTINGS.items():
        per_step = _profiled_syncs(dict(kw))
        cb = phase_timer.PhaseTimerCallback(summary=False, log_dir=tempfile.mkdtemp())
        _trainer(12, 8, 512, [cb], **kw).train()
        timer = cb.timer
        say(f"  {name:38s} {per_step:5.2f} a step | census {timer.sync_census}, "
            f"{sum(s.count for s in timer.syncs)} a step")
        for s in timer.syncs:
            cause = (s.cause or "(no known cause)").split(":")[0]
            say(f"      {s.count}x {s.phase:13s} {s.frames[0] if s.frames else s.where}  `{s.code}`  <- {cause}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="overhead,syncs")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers

    say(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  transformers {transformers.__version__}  "
        f"{time.strftime('%Y-%m-%d')}")
    only = args.only.split(",")
    if "syncs" in only:
        syncs()
    if "overhead" in only:
        overhead(args.pairs, args.steps)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
