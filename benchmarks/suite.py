"""phase-timer's proof on a GPU: overhead, accuracy, stalls, memory, host cost.  One command, one table last.

    PYTHONPATH=. python benchmarks/suite.py [--quick] [--out DIR] [--only SECTIONS]

Sections (``--only`` takes a comma-separated subset; all by default):
``overhead``, ``accuracy``, ``stalls``, ``memory`` (in this process) and the finer
runs, each its own process writing its own file, its table copied into the last one:
``fine`` (``launch_bound.py`` and ``lightning_launch_bound.py``: the launch-bound
overhead of both doors resolved to ~0.5%), ``host`` (``host_cost.py``: host time per
step in a hot loop) and ``insitu`` (``in_situ_primitives.py``: the driver calls'
cost inside a real launch-bound loop) and ``truth`` (``truth.py``: every phase of both doors
against markers at the boundaries a user means, on a 32k-vocabulary LM and a host-bound
conv net, read from the profiler's timeline and from timing events).

Overhead: the same loop with and without a timer, runs interleaved (A B A B ...),
median of the per-pair ratios, for the GPU-bound model, through the plain loop and a
Lightning Trainer, beside what a user would pick instead (``--no-competitors``: phase-timer
alone).  The launch-bound model's overhead is ``fine``'s: interleaved short blocks, the one
method that resolves a few percent there.
Accuracy: torch.profiler's kernel timeline as ground truth.  Stalls: sync calls in
the profiler's runtime-API trace.  Memory: RSS and live events over a long run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.models import GPU_BOUND, LAUNCH_BOUND, Cycle, Spec, make_batches, make_model, plain_step  # noqa: E402

DEV = torch.device("cuda")
SYNC_NAMES = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
LINES: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


HERE = os.path.dirname(os.path.abspath(__file__))
# section -> [(script, its arguments, more for a --quick run; a full run takes the script's defaults)]
SCRIPTS = {
    "fine": [
        ("launch_bound.py", [], ["--rounds", "30", "--inside-steps", "500"]),
        ("lightning_launch_bound.py", [], ["--rounds", "20", "--inside-steps", "500"]),
    ],
    "host": [("host_cost.py", [], ["--steps", "2000"])],
    "insitu": [("in_situ_primitives.py", [], ["--steps", "500"])],
    # Phase boundaries against markers at the user's boundaries, both truths (truth.py's docstring).
    "truth": [("truth.py", ["--truth", "profiler"], ["--steps", "40"]), ("truth.py", ["--truth", "events"], ["--steps", "40"])],
}


def run_script(name: str, args: list[str], out_dir: str) -> list[str]:
    """Run one of the finer benchmarks in its own process; its table, for the last one."""
    out = os.path.join(out_dir, "_".join([name.replace(".py", ""), *(a for a in args if not a.startswith("-"))]) + ".txt")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    proc = subprocess.run([sys.executable, os.path.join(HERE, name), *args, "--out", out], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        say(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return [f"{name}: FAILED (exit {proc.returncode})"]
    with open(out) as f:
        return [f"{name}: {line}" for line in f.read().splitlines()]


# ---------------------------------------------------------------- plain-loop variants
class PlainBench:
    """One warm model and optimizer; blocks of steps run with each way of timing in turn."""

    def __init__(self, spec: Spec) -> None:
        torch.manual_seed(0)
        self.model = make_model(spec, DEV)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.step = plain_step(self.model, self.opt, DEV)
        self.batches = make_batches(spec)
        self.block("none", 30)

    def block(self, variant: str, steps: int) -> float:
        """Seconds per step over one block of ``steps``."""
        timer = prof = None
        loader: Any = Cycle(self.batches, steps)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        if variant == "phase-timer":  # set-up, like building a Trainer: outside the timed block
            timer = phase_timer.attach(self.model, self.opt, loader, log_dir=tempfile.mkdtemp(), summary=False)
            loader = timer.loader
        torch.cuda.synchronize()  # benchmark boundary, outside the timed block
        t0 = time.perf_counter()
        if variant == "torch.profiler":
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        for batch in loader:
            if variant == "sync-every-batch":  # the common recipe: events + synchronize each step
                ev[0].record()
                self.step(batch)
                ev[1].record()
                torch.cuda.synchronize()
                ev[0].elapsed_time(ev[1])
            else:
                self.step(batch)
        torch.cuda.synchronize()  # benchmark boundary
        dt = (time.perf_counter() - t0) / steps
        if prof is not None:
            prof.__exit__(None, None, None)
        if timer is not None:
            timer.close()
        return dt


def interleaved_blocks(spec: Spec, variants: list[str], pairs: int, steps: int) -> dict[str, dict[str, float]]:
    bench = PlainBench(spec)
    return _pairs(lambda v: bench.block(v, steps), variants, pairs)


def _pairs(run, variants: list[str], pairs: int) -> dict[str, dict[str, float]]:
    """A B A B ...: per-pair ratio of each variant to the no-timer run just before it."""
    ratios: dict[str, list[float]] = defaultdict(list)
    base: list[float] = []
    for _ in range(pairs):
        for v in variants:
            a = run("none")
            b = run(v)
            ratios[v].append(b / a)
            base.append(a)
    out = {v: {"overhead_pct": 100 * (statistics.median(r) - 1), "spread_pct": 100 * (max(r) - min(r))} for v, r in ratios.items()}
    out["none"] = {"step_ms": 1e3 * statistics.median(base)}
    return out


# ---------------------------------------------------------------- Lightning variants
def lightning_module(spec: Spec):
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(spec, torch.device("cpu"))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    return Net()


def run_lightning(spec: Spec, variant: str, steps: int, warmup: int = 20) -> float:
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        t0 = t1 = 0.0

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == warmup:
                torch.cuda.synchronize()  # benchmark boundary
                Clock.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == warmup + steps:
                torch.cuda.synchronize()  # benchmark boundary
                Clock.t1 = time.perf_counter()

    callbacks: list[Any] = [Clock()]
    profiler: Any = None
    if variant == "phase-timer":
        callbacks.insert(0, phase_timer.PhaseTimer(summary=False))
    elif variant == "SimpleProfiler":
        profiler = pl.profilers.SimpleProfiler()
    elif variant == "torch.profiler":
        profiler = pl.profilers.PyTorchProfiler(dirpath=tempfile.mkdtemp(), filename="p")
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, max_steps=warmup + steps + 1, logger=pl.loggers.TensorBoardLogger(tempfile.mkdtemp()),
        callbacks=callbacks, profiler=profiler, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=50,
    )
    trainer.fit(lightning_module(spec), Cycle(make_batches(spec), warmup + steps + 1))
    return (Clock.t1 - Clock.t0) / steps


def interleaved_trainers(spec: Spec, variants: list[str], pairs: int, steps: int) -> dict[str, dict[str, float]]:
    return _pairs(lambda v: run_lightning(spec, v, steps), variants, pairs)


# ---------------------------------------------------------------- accuracy
def accuracy(spec: Spec, steps: int = 30) -> dict[str, Any]:
    """phase-timer's per-step phases vs the profiler's kernel timeline for the same steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = make_model(spec, DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batches = make_batches(spec)
    got: dict[int, dict[str, float]] = {}

    class Collect:
        def write(self, step, scalars):
            if "phase_time_step/step_ms" in scalars:
                got[step] = {k.split("/")[1][:-3]: v for k, v in scalars.items()}

        def flush(self):
            pass

        def close(self):
            pass

    warm = 10
    timer = phase_timer.attach(model, opt, Cycle(batches, warm + steps), log_dir=tempfile.mkdtemp(), per_step=True,
                               warmup_steps=0, summary=False, copy_to_device=True)
    timer.core._sinks.append(Collect())
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    it = iter(timer.loader)
    for i in range(warm + steps):
        if i == warm:
            torch.cuda.synchronize()  # benchmark boundary
            prof.__enter__()
        with record_function(f"truth:{i}:h2d"):
            x, y = next(it)  # the wrapper copies: h2d
        with record_function(f"truth:{i}:forward"):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
        with record_function(f"truth:{i}:backward"):
            loss.backward()
        with record_function(f"truth:{i}:optimizer"):
            opt.step()
    torch.cuda.synchronize()  # benchmark boundary
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(trace)
    timer.close()
    truth = truth_from_trace(trace)
    rows = {}
    for phase in ("h2d", "forward", "backward", "optimizer", "step"):
        common = [s for s in truth if s in got and phase in truth[s] and s - 1 in truth]
        t = statistics.median(truth[s][phase] for s in common)
        m = statistics.median(got[s][phase] for s in common)
        rows[phase] = {"truth_ms": t, "phase_timer_ms": m, "diff_ms": m - t, "ok": abs(m - t) <= max(0.02 * t, 0.05)}
    return rows


def truth_from_trace(path: str) -> dict[int, dict[str, float]]:
    """Per step and phase: GPU time from the previous phase's last op end to this phase's last op end."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("truth:")]
    launches = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ranges.sort()
    starts = [r[0] for r in ranges]
    import bisect

    last_end: dict[tuple[int, str], float] = {}
    for op in ops:
        ts = launches.get(op.get("args", {}).get("correlation"))
        if ts is None:
            continue
        i = bisect.bisect_right(starts, ts) - 1  # the range open when the host launched it
        if i < 0 or ts > ranges[i][1]:
            continue
        _, step, phase = ranges[i][2].split(":")
        key = (int(step), phase)
        last_end[key] = max(last_end.get(key, 0.0), op["ts"] + op["dur"])
    order = ("h2d", "forward", "backward", "optimizer")
    seq = sorted({s for s, _ in last_end})
    out: dict[int, dict[str, float]] = {}
    for s in seq:
        prev = last_end.get((s - 1, "optimizer"))
        if prev is None or any((s, p) not in last_end for p in order):
            continue
        phases, t = {}, prev
        for p in order:
            phases[p] = (last_end[(s, p)] - t) / 1e3
            t = last_end[(s, p)]
        phases["step"] = (t - prev) / 1e3
        out[s] = phases  # the loop index is phase-timer's step index (attached with no warm-up)
    return out


def simple_profiler_numbers(spec: Spec, steps: int = 40) -> dict[str, float]:
    """Lightning's SimpleProfiler (host clock) on the same model: medians per action, ms."""
    import lightning.pytorch as pl

    prof = pl.profilers.SimpleProfiler()
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=steps, logger=False, profiler=prof,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(lightning_module(spec), Cycle(make_batches(spec), steps + 1))
    out = {}
    for name, durs in prof.recorded_durations.items():
        short = name.split(".")[-1] if "." in name else name
        if any(k in name for k in ("batch_to_device", "training_step", "backward", "optimizer_step", "run_training_batch")):
            out[short] = 1e3 * statistics.median(durs[5:] or durs)
    return out


# ---------------------------------------------------------------- stalls
def sync_counts(spec: Spec, with_timer: bool, steps: int = 60) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = make_model(spec, DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = plain_step(model, opt, DEV)
    batches = make_batches(spec)
    timer = phase_timer.attach(model, opt, Cycle(batches, 20 + steps), log_dir=tempfile.mkdtemp(), summary=False) if with_timer else None
    loader = timer.loader if timer else Cycle(batches, 20 + steps)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    pending = []
    for i, batch in enumerate(loader):
        if i == 20:
            torch.cuda.synchronize()  # benchmark boundary
            prof.__enter__()
        step(batch)
        if timer is not None and i >= 20:
            pending.append(timer.core.pending)
    prof.__exit__(None, None, None)  # before the final drain
    names = [e.name for e in prof.events()]
    counts = {n: names.count(n) for n in SYNC_NAMES}
    counts["sync copies (cudaMemcpy)"] = names.count("cudaMemcpy")
    if timer is not None:
        timer.close()
        counts["mean steps in flight"] = statistics.mean(pending)
    return counts


# ---------------------------------------------------------------- memory
def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def long_run(steps: int) -> list[tuple[int, float, int, int]]:
    spec = Spec("tiny", width=32, depth=1, batch=16)
    model = make_model(spec, DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    step = plain_step(model, opt, DEV)
    samples = []
    with phase_timer.attach(model, opt, Cycle(make_batches(spec), steps), log_dir=tempfile.mkdtemp(), summary=False) as timer:
        for i, batch in enumerate(timer.loader):
            step(batch)
            if i % (steps // 10) == 0 or i == steps - 1:
                gc.collect()
                samples.append((i, rss_mb(), timer.core.clock.live_marks, timer.core.pending))
                say(f"memory    step {i}: RSS {samples[-1][1]:.0f} MB, live events {samples[-1][2]}, pending {samples[-1][3]}")
    return samples


# ---------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer pairs and steps (a smoke run)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--only", default="overhead,accuracy,stalls,memory,fine,host,insitu,truth")
    parser.add_argument("--doors", default="plain,lightning", help="which doors the overhead runs use")
    parser.add_argument("--memory-steps", type=int, default=None, help="steps of the memory run (default 100k; --quick 20k)")
    parser.add_argument("--no-competitors", action="store_true", help="overhead of phase-timer only (no other tools)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only.split(","))
    if unknown := only - {"overhead", "accuracy", "stalls", "memory", *SCRIPTS}:
        parser.error(f"--only: unknown sections {sorted(unknown)}")
    doors = set(args.doors.split(","))
    pairs = 3 if args.quick else 11
    say(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  date {time.strftime('%Y-%m-%d')}")
    table: list[str] = []
    results: dict[str, Any] = {}
    if "overhead" in only:
        # GPU-bound only: on the launch-bound model long A/B runs cannot read a few percent
        # (the host's speed drifts by more), so its overhead is the ``fine`` section's.
        for spec, steps in ((GPU_BOUND, 100),):
            res_by_door = {}
            plain_v = ["phase-timer"] + ([] if args.no_competitors else ["sync-every-batch", "torch.profiler"])
            lightning_v = ["phase-timer"] + ([] if args.no_competitors else ["SimpleProfiler", "torch.profiler"])
            if "plain" in doors:
                res_by_door["plain"] = interleaved_blocks(spec, plain_v, pairs, steps)
            if "lightning" in doors:
                res_by_door["lightning"] = interleaved_trainers(spec, lightning_v, max(3, pairs - 4), 2 * steps)
            say(f"{spec.name}: {res_by_door}")
            results[f"overhead/{spec.name}"] = res_by_door
            for door, res in res_by_door.items():
                for v, r in res.items():
                    if v != "none":
                        table.append(f"overhead  {door:9s} {spec.name:12s} {v:18s} {r['overhead_pct']:+7.2f}%  (spread {r['spread_pct']:.2f}%, step {res['none']['step_ms']:.2f} ms)")
    if "accuracy" in only:
        acc = accuracy(GPU_BOUND)
        results["accuracy"] = acc
        say(f"accuracy: {acc}")
        for p, r in acc.items():
            table.append(f"accuracy  {p:10s} truth {r['truth_ms']:8.3f} ms  phase-timer {r['phase_timer_ms']:8.3f} ms  diff {r['diff_ms']:+.3f} ms  {'OK' if r['ok'] else 'MISS'}")
        sp = simple_profiler_numbers(GPU_BOUND)
        results["simple_profiler"] = sp
        for k, v in sp.items():
            table.append(f"host clock (SimpleProfiler) {k:40s} {v:8.3f} ms")
    if "stalls" in only:
        for spec in (GPU_BOUND, LAUNCH_BOUND):
            a, b = sync_counts(spec, False), sync_counts(spec, True)
            results[f"stalls/{spec.name}"] = {"without": a, "with": b}
            table.append(f"stalls    {spec.name:12s} without {a}  with {b}")
    if "memory" in only:
        samples = long_run(args.memory_steps or (20_000 if args.quick else 100_000))
        results["memory"] = samples
        table.append("memory    step, RSS MB, live events, pending: " + "; ".join(f"{i}: {r:.0f} {e} {p}" for i, r, e, p in samples))
    for section, scripts in SCRIPTS.items():
        if section in only:
            for name, always, quick in scripts:
                lines = run_script(name, always + (quick if args.quick else []), args.out)
                results[section + "/" + " ".join([name, *always])] = lines
                table += lines
    tag = "-".join(sorted(only)) + ("" if doors == {"plain", "lightning"} else "-" + "-".join(sorted(doors)))
    with open(os.path.join(args.out, f"suite-{tag}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, f"suite-{tag}.txt"), "w") as f:
        f.write("\n".join(LINES + ["", *table]) + "\n")
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
