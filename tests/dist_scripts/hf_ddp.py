"""A ``transformers.Trainer`` under torchrun (DDP through accelerate, gloo on the CPU), with
``PhaseTimerCallback``; used by the distributed tests.

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/hf_ddp.py --out DIR [--slow-forward S] [--planted-hours]

Rank ``--slow-rank`` sleeps in every training forward (``--planted-hours``, on the CPU: and moves its
host clock an hour per millisecond of that sleep, a lead no load on the runner can blur).  Rank zero prints a last line
``RESULT {json}``: its timer's log dir and summary path, and each rank's timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from benchmarks.models import Tokens
from phase_timer import PhaseTimerCallback
from tests.helpers import HostHours


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=23)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-forward", type=float, default=0.0)
    p.add_argument("--planted-hours", action="store_true")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    clock = None
    if args.planted_hours and not torch.cuda.is_available():  # before the timer exists (it takes the clock then)
        clock = HostHours()
        time.perf_counter_ns = clock
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    if rank == args.slow_rank and args.slow_forward:

        def slow(module: torch.nn.Module, inputs: object) -> None:
            if module.training:
                time.sleep(args.slow_forward)
                if clock is not None:
                    clock.jump(1000 * args.slow_forward)

        model.register_forward_pre_hook(slow)
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=4, max_steps=args.steps,
                              logging_steps=args.window, report_to="none", save_strategy="no", use_cpu=True,
                              disable_tqdm=True, ddp_backend="gloo")
    cb = PhaseTimerCallback(warmup_steps=2)
    Trainer(model=model, args=targs, train_dataset=Tokens(512, 16, vocab=64), callbacks=[cb]).train()
    timer = cb.timer
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, timer.totals.steps)
    if rank == 0:
        print("RESULT " + json.dumps({"log_dir": timer.log_dir, "summary_path": timer.summary_path, "steps": steps,
                                      "world_size": dist.get_world_size(), "distributed": targs.parallel_mode.value}),
              flush=True)


if __name__ == "__main__":
    main()
