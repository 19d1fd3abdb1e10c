"""Host time phase-timer spends per step, measured directly (no training around it).

Times, on the CUDA device, the primitives (DESIGN.md's table) and the core's whole
per-step path: begin + 4 phase switches + end (which polls and resolves the step
that finished), plus the amortized cost of writing a window to TensorBoard.

    python benchmarks/host_cost.py [--steps 20000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from phase_timer.clock import CudaClock, NativeCudaClock
from phase_timer.core import TimingCore
from phase_timer.sinks import BackgroundSink, SummaryWriterSink, open_event_file


def per_call_us(fn, n: int, repeats: int = 7) -> float:
    """Median over repeats of the mean host time of ``fn()``, microseconds."""
    runs = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t) / n / 1e3)
    return statistics.median(runs)


def primitives(n: int) -> dict[str, float]:
    stream = torch.cuda.current_stream()
    ev, ev2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    ev2.record(stream)
    torch.cuda.synchronize()
    raw = torch._C._cuda_getCurrentRawStream
    out = {
        "Event.record() no stream": per_call_us(lambda: ev.record(), n),
        "Event.record(stream)": per_call_us(lambda: ev.record(stream), n),
        "torch.cuda.current_stream()": per_call_us(torch.cuda.current_stream, n),
        "_cuda_getCurrentRawStream(i)": per_call_us(lambda: raw(0), n),
    }
    torch.cuda.synchronize()
    out["Event.query() (done)"] = per_call_us(ev.query, n)
    out["Event.elapsed_time()"] = per_call_us(lambda: ev.elapsed_time(ev2), n)
    for clock in clocks():
        name = type(clock).__name__
        mark = clock.mark
        out[f"{name}.mark() + release"] = per_call_us(lambda: clock.release([mark()]), n)
        marks = [mark() for _ in range(5)]
        torch.cuda.synchronize()
        out[f"{name}.done()"] = per_call_us(lambda: clock.done(marks[-1]), n)
        out[f"{name}.spans(5 marks)"] = per_call_us(lambda: clock.spans(marks), n)
    return out


def clocks() -> list:
    """The clocks to compare: the native one (if built) and torch's events."""
    return ([NativeCudaClock()] if NativeCudaClock is not None else []) + [CudaClock()]


def core_step(n: int, sink: str, window: int, clock_type: type) -> float:
    """Per step: begin, 4 switches, end (poll + resolve + stats + amortized window write)."""
    sinks: list = []
    tmp = tempfile.mkdtemp()
    if sink == "event file (default)":
        sinks.append(open_event_file(tmp, per_step=False))
    elif sink == "user's SummaryWriter":
        from torch.utils.tensorboard import SummaryWriter

        sinks.append(BackgroundSink(SummaryWriterSink(SummaryWriter(tmp), owned=True), "tensorboard"))
    core = TimingCore(clock_type(), sinks, window=window, warmup_steps=0, max_pending=64)
    x = torch.randn(256, 256, device="cuda")
    state = {"i": 0}

    def step() -> None:
        i = state["i"] = state["i"] + 1
        core.begin_step(i, "h2d")
        core.add_host("data_wait", 0.1)
        core.phase("forward")
        core.phase("backward")
        core.phase("optimizer")
        core.end_step()

    for _ in range(200):  # warm the pool
        step()
    torch.cuda.synchronize()
    # A little device work per step, so the events complete while the host runs.
    x.mul_(1.0)
    us = per_call_us(step, n)
    core.finish()
    return us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = primitives(args.steps)
    for _ in range(2):  # twice, interleaved: the spread shows the noise
        for clock_type in [type(c) for c in clocks()]:
            for sink in ("none", "event file (default)", "user's SummaryWriter"):
                key = f"core step, {clock_type.__name__}, {sink} (window 50)"
                rows.setdefault(key, []).append(core_step(args.steps, sink=sink, window=50, clock_type=clock_type))
    lines = [f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}"]
    lines += [f"{k:55s} " + " ".join(f"{x:8.2f}" for x in (v if isinstance(v, list) else [v])) + " us" for k, v in rows.items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
