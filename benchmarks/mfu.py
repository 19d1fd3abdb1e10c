"""Throughput, FLOPs and MFU on a GPU: against the analytic count, the loop's own clock, and Lightning's ThroughputMonitor.

    PYTHONPATH=. python benchmarks/mfu.py [--steps 40] [--batch 8] [--seq 1024] [--only plain,compile,lightning,hf] [--out FILE]

A GPT-2-small from a config (124M, bf16 autocast, SDPA attention, fused AdamW), ``batch x seq`` tokens a step:

- ``plain`` / ``compile``: ``attach()``; the counted FLOPs a token (the model's: recompute out) beside
  ``6 N + 12 L d T`` (``flops.gpt2_flops_per_token``), and tokens/s from the summary beside the loop's own:
  tokens over the wall time of the same steps (one ``torch.cuda.synchronize()`` before the first timed
  step, after the census's, and one after the last: the benchmark's, not the timer's).  ``compile``:
  the transformer under ``torch.compile``; the count runs eagerly (``set_stance``) and the compiled code after.
- ``lightning``: the same model in a LightningModule (``precision="bf16-mixed"``), three runs: PhaseTimer
  alone, ThroughputMonitor alone (its ``flops_per_batch`` the analytic count, its window the same steps phase-timer times), both;
  samples/s and TFLOP/s side by side, and how many ``torch.cuda.synchronize()`` calls each run made a step.
- ``hf``: the 🤗 Trainer with ``PhaseTimerCallback``: tokens/s and MFU beside its own ``train_samples_per_second``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.provenance import code_line  # noqa: E402
from phase_timer.measures.flops import gpt2_flops_per_token  # noqa: E402

LINES: list[str] = []
ROWS: list[tuple[str, ...]] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def _gpt2(seq: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_positions=seq)).cuda()


def _data(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 50257, (batch, seq), generator=g) for _ in range(steps)]


class SyncCount:
    """Counts torch.cuda.synchronize() calls (the benchmark's own excluded) while on."""

    def __init__(self) -> None:
        self.n = 0
        self._orig = torch.cuda.synchronize

    def __enter__(self) -> SyncCount:
        def counted(*a: Any, **k: Any) -> Any:
            self.n += 1
            return self._orig(*a, **k)

        torch.cuda.synchronize = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize = self._orig


def _read(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def plain(args: argparse.Namespace, compiled: bool) -> None:
    model = _gpt2(args.seq)
    if compiled:
        model.transformer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    warm = 5
    data = _data(args.steps + warm, args.batch, args.seq)
    t0 = t1 = 0.0
    with phase_timer.attach(model, opt, data, copy_to_device=True, log_dir=tempfile.mkdtemp(), warmup_steps=warm,
                            summary=False) as timer:
        for i, ids in enumerate(timer.loader):
            if i == warm:  # the first timed step's batch is here (the census ended at this fetch)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
    data_ = _read(timer.summary_path)
    fl, thr = data_["flops"], data_["throughput"]
    tokens = args.batch * args.seq
    analytic = gpt2_flops_per_token(model.config, args.seq)
    counted = fl["per_step"]["model"] / tokens
    own = args.steps * tokens / (t1 - t0)
    frames = None
    if compiled:
        from torch._dynamo.utils import counters

        frames = counters["frames"]["ok"]
    name = "plain+compile" if compiled else "plain"
    say(f"{name}: timed {data_['steps']['timed']} steps; FLOPs/token counted (model) {counted:.6g}, hardware "
        f"{fl['per_step']['hardware'] / tokens:.6g}, analytic 6N+12LdT {analytic:.6g} ({counted / analytic - 1:+.3%}); "
        f"tokens/s ours {thr['tokens_per_s']:.1f}, loop's wall {own:.1f} ({thr['tokens_per_s'] / own - 1:+.2%}); "
        f"MFU {fl['mfu']['step']:.1%} (forward {fl['mfu']['forward']:.1%}, backward {fl['mfu']['backward']:.1%}) of "
        f"{fl['peak']['tflops']} TFLOP/s ({fl['peak']['precision']}, {fl['peak']['device']}); step "
        f"{data_['phases']['step']['mean_ms']:.2f} ms" + (f"; dynamo frames compiled {frames}" if compiled else ""))
    ROWS.append((name, f"{counted / analytic - 1:+.3%}", f"{thr['tokens_per_s']:.0f}", f"{own:.0f}",
                 f"{thr['tokens_per_s'] / own - 1:+.2%}", f"{fl['mfu']['step']:.1%}"))


def lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ThroughputMonitor

    seq, batch = args.seq, args.batch
    from transformers import GPT2Config

    analytic = gpt2_flops_per_token(GPT2Config(n_positions=seq), seq) * batch * seq

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2(seq)
            self.flops_per_batch = analytic

        def training_step(self, ids: torch.Tensor, idx: int) -> torch.Tensor:
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    results = {}
    for name in ("phase-timer", "ThroughputMonitor", "both"):
        cbs: list[Any] = []
        timer = monitor = None
        if name != "ThroughputMonitor":
            timer = phase_timer.PhaseTimer(log_dir=tempfile.mkdtemp(), summary=False, log_every_n_steps=10)
            cbs.append(timer)
        if name != "phase-timer":
            # its window: the last steps + 1 batch ends, i.e. the same steps phase-timer times (after its 5 warm-up)
            monitor = ThroughputMonitor(batch_size_fn=lambda b: b.shape[0], length_fn=lambda b: b.numel(),
                                        window_size=args.steps + 1)
            cbs.append(monitor)
        logged: dict[str, float] = {}

        class Keep(pl.Callback):
            def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
                logged.update({k: float(v) for k, v in trainer.callback_metrics.items()})

        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(tempfile.mkdtemp())
        # Lightning logs every step (ThroughputMonitor computes its rates at a logging step: its last, step 45,
        # then covers the same steps as phase-timer's 40), in all three runs alike
        trainer = pl.Trainer(max_steps=args.steps + 5, precision="bf16-mixed", logger=logger, callbacks=cbs,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             log_every_n_steps=1, num_sanity_val_steps=0)
        loader = torch.utils.data.DataLoader(_data(args.steps + 5, batch, seq), batch_size=None, pin_memory=True)
        with SyncCount() as syncs:
            t0 = time.perf_counter()
            trainer.fit(LM(), loader)
            wall = time.perf_counter() - t0
        row: dict[str, Any] = {"syncs_per_step": syncs.n / (args.steps + 5), "wall_s": wall}
        if name != "both":
            row["profiler_syncs_per_step"] = _profiled_syncs(LM, cbs_again(name, timer, monitor), batch, seq)
        if timer is not None:
            d = _read(timer.summary_path)
            row.update(ours_samples=d["throughput"]["samples_per_s"], ours_tflops=d["flops"]["tflops_per_s"],
                       ours_mfu=d["flops"]["mfu"]["step"], ours_peak=d["flops"]["peak"]["tflops"],
                       ours_flops=d["flops"]["per_step"]["model"], period=d["phases"]["period"]["mean_ms"])
        if monitor is not None:
            import csv

            metrics_file = os.path.join(logger.log_dir, "metrics.csv")
            last: dict[str, str] = {}
            with open(metrics_file) as f:
                for r in csv.DictReader(f):
                    if any(k.endswith("device/samples_per_sec") and v for k, v in r.items()):
                        last = {k.split("device/")[-1]: v for k, v in r.items() if "device/" in k}
            row.update(tm_samples=float(last["samples_per_sec"]), tm_tflops=float(last["flops_per_sec"]) / 1e12,
                       tm_mfu=float(last.get("mfu") or "nan"),
                       tm_peak=monitor.available_flops / 1e12 if monitor.available_flops else None)
        results[name] = row
        say(f"lightning, {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in row.items()))
    both = results["both"]
    say(f"lightning, both callbacks on the same run: samples/s ours {both['ours_samples']:.2f} vs ThroughputMonitor "
        f"{both['tm_samples']:.2f} ({both['ours_samples'] / both['tm_samples'] - 1:+.2%}); TFLOP/s {both['ours_tflops']:.1f} "
        f"vs {both['tm_tflops']:.1f} ({both['ours_tflops'] / both['tm_tflops'] - 1:+.2%}); MFU {both['ours_mfu']:.2%} of "
        f"{both['ours_peak']} vs {both['tm_mfu']:.2%} of {both['tm_peak']}; counted FLOPs/step {both['ours_flops']:.6g} vs "
        f"analytic {analytic:.6g} ({both['ours_flops'] / analytic - 1:+.3%})")
    say(f"lightning, syncs a step (torch.cuda.synchronize calls; the profiler's runtime/driver sync calls over steps "
        f"8-19): phase-timer alone {results['phase-timer']['syncs_per_step']:.2f} "
        f"({results['phase-timer']['profiler_syncs_per_step']:.2f}), ThroughputMonitor alone "
        f"{results['ThroughputMonitor']['syncs_per_step']:.2f} ({results['ThroughputMonitor']['profiler_syncs_per_step']:.2f}); "
        f"samples/s phase-timer alone "
        f"{results['phase-timer']['ours_samples']:.2f}, ThroughputMonitor alone "
        f"{results['ThroughputMonitor']['tm_samples']:.2f}")
    ROWS.append(("lightning (both)", f"{both['ours_flops'] / analytic - 1:+.3%}", f"{both['ours_samples'] * seq:.0f}",
                 f"{both['tm_samples'] * seq:.0f} (TM)", f"{both['ours_samples'] / both['tm_samples'] - 1:+.2%}",
                 f"{both['ours_mfu']:.1%} / TM {both['tm_mfu']:.1%}"))


SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cuCtxSynchronize",
              "cuStreamSynchronize", "cuEventSynchronize")


def cbs_again(name: str, timer: Any, monitor: Any) -> list[Any]:
    """Fresh callbacks of the same kind (a callback's state is its run's)."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    if name == "phase-timer":
        return [phase_timer.PhaseTimer(log_dir=tempfile.mkdtemp(), summary=False, log_every_n_steps=10)]
    return [ThroughputMonitor(batch_size_fn=lambda b: b.shape[0], length_fn=lambda b: b.numel(), window_size=10)]


def _profiled_syncs(module: Any, callbacks: list[Any], batch: int, seq: int, steps: int = 12, first: int = 8) -> float:
    """Host-device waits a step (the runtime's and the driver's sync calls on the profiler's timeline) over steps
    ``first..first+steps-1`` of a short fit: the ones a callback adds show as the difference between runs."""
    import lightning.pytorch as pl
    from torch.profiler import ProfilerActivity, profile, schedule

    counts: list[int] = []

    def ready(prof: Any) -> None:
        counts.append(sum(e.count for e in prof.key_averages() if e.key in SYNC_CALLS))

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=first - 1, warmup=1, active=steps, repeat=1), on_trace_ready=ready)

    class Step(pl.Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            prof.step()

    trainer = pl.Trainer(max_steps=first + steps + 2, precision="bf16-mixed", logger=False,
                         callbacks=[*callbacks, Step()], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=10, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(_data(first + steps + 2, batch, seq), batch_size=None, pin_memory=True)
    with prof:
        trainer.fit(module(), loader)
    return counts[0] / steps if counts else float("nan")


def hf(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from benchmarks.models import Tokens

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=args.seq))
    cb = phase_timer.PhaseTimerCallback(summary=False)
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
                              max_steps=args.steps + 5, bf16=True, report_to="none", save_strategy="no",
                              disable_tqdm=True, logging_steps=10, optim="adamw_torch_fused")
    out = Trainer(model=model, args=targs, train_dataset=Tokens(args.batch * (args.steps + 5), args.seq),
                  callbacks=[cb]).train()
    d = _read(cb.summary_path)
    fl, thr = d["flops"], d["throughput"]
    tokens = args.batch * args.seq
    analytic = gpt2_flops_per_token(model.config, args.seq)
    counted = fl["per_step"]["model"] / tokens
    hf_tokens = out.metrics["train_samples_per_second"] * args.seq
    say(f"hf: timed {d['steps']['timed']} steps; FLOPs/token counted {counted:.6g} vs analytic {analytic:.6g} "
        f"({counted / analytic - 1:+.3%}); tokens/s ours {thr['tokens_per_s']:.1f} (the Trainer's own "
        f"train_samples_per_second x seq, over the whole train() with its first steps: {hf_tokens:.1f}); MFU "
        f"{fl['mfu']['step']:.1%} (forward {fl['mfu']['forward']:.1%}, backward {fl['mfu']['backward']:.1%}) of "
        f"{fl['peak']['tflops']} ({fl['peak']['precision']}, {fl['peak']['device']})")
    ROWS.append(("hf", f"{counted / analytic - 1:+.3%}", f"{thr['tokens_per_s']:.0f}", f"{hf_tokens:.0f} (HF)", "",
                 f"{fl['mfu']['step']:.1%}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--only", default="plain,compile,lightning,hf")
    ap.add_argument("--out")
    args = ap.parse_args()
    say(f"{code_line()}")
    say(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  GPT-2-small {args.batch}x{args.seq} bf16, "
        f"{args.steps} timed steps")
    for part in args.only.split(","):
        {"plain": lambda: plain(args, False), "compile": lambda: plain(args, True), "lightning": lambda: lightning(args),
         "hf": lambda: hf(args)}[part]()
    say("")
    say(f"{'run':<18} {'FLOPs vs 6N+12LdT':>18} {'tokens/s ours':>14} {'reference':>16} {'diff':>8}  MFU")
    for r in ROWS:
        say(f"{r[0]:<18} {r[1]:>18} {r[2]:>14} {r[3]:>16} {r[4]:>8}  {r[5]}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
