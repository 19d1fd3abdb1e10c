"""A small 🤗 Trainer script with no phase-timer in it (``--by-hand`` passes the callback itself): a tiny GPT-2
built from a config, on the CPU, for ``tests/cli/test_watch_run.py``.

    python tests/run_scripts/hf_train.py OUTPUT_DIR [--steps N] [--by-hand]
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--by-hand", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    callbacks = []
    if args.by_hand:
        from phase_timer import PhaseTimerCallback

        callbacks.append(PhaseTimerCallback(warmup_steps=2))
    targs = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=4, max_steps=args.steps,
                              logging_steps=10, use_cpu=True, disable_tqdm=True, report_to="none", save_strategy="no")
    Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks).train()
    print("script: done")


if __name__ == "__main__":
    main()
