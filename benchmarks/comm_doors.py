"""Exposed communication through the Lightning and 🤗 doors on real NCCL: rank zero's each step against the profiler.

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/comm_doors.py --door lightning [--out FILE]
    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/comm_doors.py --door hf [--out FILE]

One case a door, as a user has it: ``comm_nccl.py``'s GPT-2-class LM (148 parameter tensors) under the door's own
DDP (Lightning's ``DDPStrategy``; the 🤗 Trainer's, through accelerate), bf16, fused AdamW, the callback with
``per_step=True``.  A callback of the benchmark's launches a marker kernel at each batch's start and profiles the
last ``--profiled`` steps (device activity only; ``--prewarm N`` starts it N batches earlier, uncompared); the truth
is ``nccl_truth.py``'s union-of-intervals rule per step, queued, strict and blocked (the launches matched by
correlation id, as ``comm_nccl.py --launches``).  phase-timer's per-step ``forward.comm_wait + backward.comm_wait`` is read back from its TensorBoard file
with tensorboard's reader (rank zero writes it), the last ``--profiled`` steps in order.  Rank zero prints the
per-step table and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.comm_nccl import GPT, bucket_samples, fmt  # noqa: E402
from benchmarks.nccl_truth import (  # noqa: E402
    device_activities, device_intervals, launch_times, per_step, per_step_blocked, within)
from benchmarks.provenance import code_line  # noqa: E402
from phase_timer.phases import COMM_PARTS
from phase_timer.outputs.tags import step_tag  # noqa: E402


class Profiled:
    """A marker kernel at each batch's start; the profiler over the last ``n`` of ``total`` batches."""

    def __init__(self, total: int, n: int, prewarm: int = 0) -> None:
        self.first, self.prof, self.batch = total - n, None, 0
        self.start = max(0, self.first - prewarm)  # the profiler's start: CUPTI's cost on the host settles first
        self.buckets: list | None = None  # phase-timer's copies samples, each bucket's (the lightning door)

    def begin(self) -> None:
        if self.batch == self.start:
            torch.cuda.synchronize()  # the benchmark's: the profiled steps begin on an idle device
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.start()
        if self.prof is not None and self.batch >= self.first:
            torch.cuda._sleep(100)  # the marker: this step begins here on the compute stream
        self.batch += 1

    def truth(self) -> list[dict]:
        if self.prof is None:
            return []
        torch.cuda.synchronize()  # the benchmark's
        self.prof.stop()
        events = self.prof.events()
        rows = per_step(device_intervals(events), ("nccl",), "spin_kernel")
        blocked = per_step_blocked(device_activities(events), launch_times(events), ("nccl",), "spin_kernel")
        for row, bl in zip(rows, blocked):
            row["blocked"] = bl["blocked"]
        return rows


def copies_estimate(log_dir: str) -> tuple[float | None, float | None]:
    """phase-timer's estimates of DDP's copies a synced backward (its run summary's ``copies_ms`` and, where a step
    waited, ``copies_waited_ms``), or None (none timed).  A step's ``comm_wait`` is its span less one of them, never
    below zero (``run.less_copies``): :func:`span_of` undoes it where it is positive."""
    from phase_timer.outputs.run_summary import FILE_NAME

    for root, _dirs, files in os.walk(log_dir):
        if FILE_NAME in files:
            with open(os.path.join(root, FILE_NAME)) as fh:
                block = json.load(fh).get("communication") or {}
            return block.get("copies_ms"), block.get("copies_waited_ms")
    return None, None


def span_of(wait: float, copy: float | None, low: float | None) -> float | None:
    """The span before DDP's copies came off, from a step's ``comm_wait`` (positive) and the run's two estimates:
    ``run.less_copies`` took ``low`` where the span exceeded ``copy`` by more than ``WAITED_MS``, i.e. where the wait
    exceeds ``copy - low + WAITED_MS``; else ``copy`` (None: no estimate)."""
    from phase_timer.measures.comm.run import WAITED_MS

    if copy is None:
        return None
    if low is not None and wait > copy - low + WAITED_MS:
        return wait + low
    return wait + copy


def tokens(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return [torch.randint(0, args.vocab, (args.seq,), generator=g) for _ in range(4 * args.batch)]


def lightning_run(args: argparse.Namespace, log_dir: str, prof: Profiled) -> None:
    try:
        import lightning.pytorch as pl
    except ImportError:  # pragma: no cover
        import pytorch_lightning as pl  # type: ignore[no-redef]
    from phase_timer import PhaseTimer
    from phase_timer.measures.comm import run as comm_run

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = GPT(args.vocab, args.width, args.depth, args.seq, 0.0)

        def training_step(self, batch, _idx):  # noqa: ANN001, ANN202
            return nn.functional.cross_entropy(self.net(batch).flatten(0, 1).float(), batch.flatten())

        def configure_optimizers(self):  # noqa: ANN202
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    timer = PhaseTimer(per_step=True, log_every_n_steps=10, log_dir=log_dir)

    class Marker(pl.Callback):
        def on_train_batch_start(self, *_a) -> None:  # noqa: ANN002
            prof.begin()

        def on_train_batch_end(self, *_a) -> None:  # noqa: ANN002
            prof.buckets = bucket_samples(comm_run.find(timer.core)) if timer.core is not None else None

    data = torch.utils.data.DataLoader(tokens(args), batch_size=args.batch, shuffle=False)
    trainer = pl.Trainer(accelerator="gpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy="ddp",
                         precision="bf16-mixed", max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer, Marker()])
    trainer.fit(Module(), data)


def hf_run(args: argparse.Namespace, log_dir: str, prof: Profiled) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from phase_timer import PhaseTimerCallback

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = GPT(args.vocab, args.width, args.depth, args.seq, 0.0)

        def forward(self, input_ids, labels=None):  # noqa: ANN001, ANN201
            logits = self.net(input_ids)
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())}

    class Marker(TrainerCallback):
        def on_step_begin(self, *_a, **_k) -> None:  # noqa: ANN002, ANN003
            prof.begin()

    ds = [{"input_ids": t, "labels": t} for t in tokens(args)]
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch, max_steps=args.steps,
                              bf16=True, optim="adamw_torch_fused", learning_rate=1e-4, report_to=[],
                              save_strategy="no", logging_steps=10_000, remove_unused_columns=False,
                              dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=LM(), args=targs, train_dataset=ds,
            callbacks=[PhaseTimerCallback(per_step=True, window=10, log_dir=log_dir), Marker()]).train()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--door", choices=("lightning", "hf"), required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profiled", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--prewarm", type=int, default=0, help="start the profiler this many batches before the first "
                   "compared one (comm_nccl.py's --prewarm)")
    p.add_argument("--out")
    args = p.parse_args()
    log_dir = os.environ.get("COMM_DOORS_LOG_DIR") or tempfile.mkdtemp()
    prof = Profiled(args.steps, args.profiled, args.prewarm)
    (lightning_run if args.door == "lightning" else hf_run)(args, log_dir, prof)
    truth = prof.truth()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[int, float] = {}
    for root, _dirs, files in os.walk(log_dir):
        if not any(f.startswith("events.out.tfevents") for f in files):
            continue
        acc = EventAccumulator(root, size_guidance={"scalars": 0})
        acc.Reload()
        for part in COMM_PARTS:
            if step_tag(part) in acc.Tags()["scalars"]:
                for e in acc.Scalars(step_tag(part)):
                    series[e.step] = series.get(e.step, 0.0) + e.value
    steps = sorted(series)[-len(truth):] if truth else []
    copy_ms, copy_low_ms = copies_estimate(log_dir)
    lines = [code_line(), f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; the {args.door} door under "
             f"its own DDP, world {os.environ.get('WORLD_SIZE', '1')}; GPT width {args.width} x {args.depth}, batch {args.batch} x "
             f"{args.seq} a rank; {args.steps} steps, the last {args.profiled} profiled; rank 0, each row one step",
             "queued: the union rule with the compute stream's launch gaps (<= 3 us) filled; strict: as is; blocked: "
             "the queued rule where the compute stream has its next kernel launched, from the call's end and the "
             "device's launch latency (comm_nccl.py --launches); before cp: comm_wait with phase-timer's estimate of "
             f"DDP's copies ({fmt(copy_ms).strip()} ms a synced backward, {fmt(copy_low_ms).strip()} on a step that "
             "waited: its summary's) added back; copies, run: the "
             "profiler's device-to-device memcpy of the step, their own time and back to back (ms)",
             f"{'door':10} {'step':>5} {'comm_wait':>9} {'before cp':>9} {'queued':>8} {'diff':>8} {'strict':>8} "
             f"{'diff':>8} {'analyzers':>9} {'blocked':>8} {'diff':>8} {'copies':>8} {'run':>8}"]
    ok = strict_ok = blocked_ok = 0
    for s, t in zip(steps, truth):
        diff, sdiff = series[s] - t["exposed_queued"], series[s] - t["exposed_stream"]
        bdiff = None if t.get("blocked") is None else series[s] - t["blocked"]
        ok += within(series[s], t["exposed_queued"])
        strict_ok += within(series[s], t["exposed_stream"])
        blocked_ok += bdiff is not None and within(series[s], t["blocked"])
        before = span_of(series[s], copy_ms, copy_low_ms)
        lines.append(f"{args.door:10} {s:5d} {fmt(series[s], 9)} {fmt(before, 9)} {fmt(t['exposed_queued'])} "
                     f"{fmt(diff)} {fmt(t['exposed_stream'])} {fmt(sdiff)} {fmt(t['exposed'], 9)} "
                     f"{fmt(t.get('blocked'))} {fmt(bdiff)} {fmt(t['copies'])} {fmt(t['copies_run'])}")
    if prof.buckets is not None:
        lines.append(f"{args.door}: phase-timer's copies samples, each bucket's [queued, caught-up] (ms): "
                     f"{prof.buckets}")
    lines.append(f"{args.door}: {ok}/{len(truth)} steps within 0.1 ms or 2% of the queued rule ({strict_ok} of the "
                 f"strict, {blocked_ok} of the blocked; per-step values {len(series)}, profiled steps {len(truth)})")
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
