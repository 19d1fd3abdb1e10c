"""What each clock primitive costs the host inside a real launch-bound training loop.

    PYTHONPATH=. python benchmarks/in_situ_primitives.py [--steps 3000] [--out FILE]

``host_cost.py`` times the primitives in a hot loop, where the code and the
driver's data sit in the CPU's caches.  In a launch-bound loop they run between
hundreds of kernel launches.  This runs the launch-bound model with no timer and
makes every call phase-timer's default engine makes per step by hand -- six marks
at the phase boundaries (the step's end and the next fetch included), ``done`` on the record two steps back, its ``spans`` and
``release`` -- timing each call with ``perf_counter_ns``; then the same calls in a
hot loop; and, for scale, a one-element kernel launch both ways.  Mean and median
per call, in microseconds, the timer's own floor (an empty pair) beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_cost import print_and_save  # noqa: E402
from benchmarks.launch_bound import DEV, sync  # noqa: E402
from benchmarks.models import LAUNCH_BOUND, make_batches, make_model  # noqa: E402
from phase_timer.timing.clock import make_clock  # noqa: E402

LAG = 2  # the engine's default: the two newest records are not asked
# The engine's calls a step, with how many of each it makes.
ENGINE_CALLS = {"mark": 6, "done (record 2 steps back)": 1, "spans (6 marks)": 1, "release (6 marks)": 1}


# What a mark reads first: torch's current stream, as a raw handle (a Python call into torch).
RAW_STREAM = "torch's current raw stream (in a mark)"
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) if DEV.type == "cuda" else None
index = torch.cuda.current_device() if DEV.type == "cuda" else 0


def in_situ(steps: int) -> tuple[str, dict[str, list[int]]]:
    """The engine's calls made by hand in a real launch-bound loop: the clock's name, ns per call."""
    torch.manual_seed(0)
    model = make_model(LAUNCH_BOUND, DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batches = make_batches(LAUNCH_BOUND)
    clock = make_clock(DEV)
    tiny = torch.zeros(1, device=DEV)
    ns: dict[str, list[int]] = defaultdict(list)
    pc = time.perf_counter_ns
    pending: deque[list[Any]] = deque()

    def mark(marks: list[Any]) -> None:
        t = pc()
        marks.append(clock.mark())
        ns["mark"].append(pc() - t)

    for i in range(steps):
        x, y = batches[i % len(batches)]
        marks: list[Any] = []
        mark(marks)
        x, y = x.to(DEV, non_blocking=True), y.to(DEV, non_blocking=True)
        mark(marks)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        mark(marks)
        loss.backward()
        mark(marks)
        opt.step()
        mark(marks)  # the step's end
        opt.zero_grad(set_to_none=True)
        mark(marks)  # the next fetch: the time between steps ends
        pending.append(marks)
        if len(pending) > LAG:
            t = pc()
            finished = clock.done(pending[0][-1])
            ns["done (record 2 steps back)"].append(pc() - t)
            if finished:
                old = pending.popleft()
                t = pc()
                clock.spans(old)
                ns["spans (6 marks)"].append(pc() - t)
                t = pc()
                clock.release(old)
                ns["release (6 marks)"].append(pc() - t)
        t = pc()
        tiny.add_(1.0)
        ns["one-element kernel launch"].append(pc() - t)
        if raw_stream is not None:
            t = pc()
            raw_stream(index)
            ns[RAW_STREAM].append(pc() - t)
        t = pc()
        ns["empty (the timer's floor)"].append(pc() - t)
    sync()  # benchmark end: every record done before its events go back
    for marks in pending:
        clock.release(marks)
    return type(clock).__name__, ns


def hot(n: int) -> dict[str, list[int]]:
    clock = make_clock(DEV)
    tiny = torch.zeros(1, device=DEV)
    pc = time.perf_counter_ns
    ns: dict[str, list[int]] = defaultdict(list)

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t = pc()
        out = fn()
        ns[name].append(pc() - t)
        return out

    for _ in range(n):
        marks = [timed("mark", clock.mark) for _ in range(6)]
        sync()  # benchmark: the record's events done, as in-situ
        timed("done (record 2 steps back)", lambda: clock.done(marks[-1]))
        timed("spans (6 marks)", lambda: clock.spans(marks))
        timed("release (6 marks)", lambda: clock.release(marks))
        timed("one-element kernel launch", lambda: tiny.add_(1.0))
        if raw_stream is not None:
            timed(RAW_STREAM, lambda: raw_stream(index))
        timed("empty (the timer's floor)", lambda: None)
    return ns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hot(200)  # warm
    clock, situ = in_situ(args.steps)
    warm = hot(args.steps)
    dev = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    lines = [
        f"device {dev}  torch {torch.__version__}  clock {clock}  {time.strftime('%Y-%m-%d')}",
        f"host us per call: in a launch-bound training loop ({args.steps} steps) vs in a hot loop",
        f"{'call':32s} {'in-situ mean':>12s} {'median':>8s} {'hot mean':>9s} {'median':>8s}",
    ]
    for name, vals in situ.items():
        h = warm[name]
        lines.append(
            f"{name:32s} {statistics.fmean(vals) / 1e3:12.2f} {statistics.median(vals) / 1e3:8.2f} "
            f"{statistics.fmean(h) / 1e3:9.2f} {statistics.median(h) / 1e3:8.2f}"
        )
    per_step = sum(statistics.fmean(situ[name]) * n for name, n in ENGINE_CALLS.items())
    lines.append(f"the engine's driver calls per step, in-situ (6 marks + done + spans + release): {per_step / 1e3:.1f} us")
    print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
