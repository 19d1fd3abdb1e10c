"""Where phase-timer's overhead goes on the launch-bound model: one piece at a time.

    PYTHONPATH=. python benchmarks/diagnose_launch_bound.py [--pairs 7] [--steps 400]

Blocks of steps on one warm model, each variant right after a plain block; prints
the median per-pair ratio and the per-step p50/p90 of each variant.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import os
import tempfile
import time
import timeit
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.models import LAUNCH_BOUND, Cycle, make_batches, make_model, plain_step  # noqa: E402
from phase_timer.clock import make_clock  # noqa: E402
from phase_timer.core import TimingCore  # noqa: E402

DEV = torch.device("cuda")
_KEYS = [f"k{i}" for i in range(8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=25)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = make_model(LAUNCH_BOUND, DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = plain_step(model, opt, DEV)
    batches = make_batches(LAUNCH_BOUND)

    def block(variant: str) -> list[float]:
        timer = core = None
        loader = Cycle(batches, args.steps)
        if variant.startswith("attach"):
            if variant == "attach, torch events":
                os.environ["PHASE_TIMER_NATIVE"] = "0"
            timer = phase_timer.attach(model, opt, loader, log_dir=tempfile.mkdtemp(), summary=False)
            os.environ.pop("PHASE_TIMER_NATIVE", None)
            loader = timer.loader
            if variant == "attach, no sink":
                for sink in timer.core._sinks:
                    sink.close()
                timer.core._sinks = []
            elif variant == "attach, sink on training thread":
                timer.core._sinks = [s.sink for s in timer.core._sinks]
        elif variant.startswith("core only, 5 marks"):
            lag = int(variant.rsplit(" ", 1)[-1])
            core = TimingCore(make_clock(DEV), [], window=50, warmup_steps=5, max_pending=64, poll_lag=lag)
        elif variant == "5 raw event records, no query":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
            stream = torch.cuda.current_stream()
        elif variant == "torch hooks only (no-op bodies)":
            handles = [model.register_forward_pre_hook(lambda m, a: None), model.register_forward_hook(lambda m, a, o: None),
                       opt.register_step_pre_hook(lambda o, a, k: None), opt.register_step_post_hook(lambda o, a, k: None)]
        gc_was = gc.isenabled()
        if variant == "attach, gc off":
            gc.disable()
        times = []
        torch.cuda.synchronize()
        for i, batch in enumerate(loader):
            t = time.perf_counter_ns()
            if variant == "5 raw event records, no query":
                for ev in events[:4]:
                    ev.record(stream)
            if core is not None:
                core.begin_step(i, "h2d")
                core.phase("forward")
                core.phase("backward")
                core.phase("optimizer")
            if variant.startswith("python burn"):
                burn()
            step(batch)
            if core is not None:
                core.end_step()
            if variant == "5 raw event records, no query":
                events[4].record(stream)
            times.append(time.perf_counter_ns() - t)
        torch.cuda.synchronize()
        if gc_was:
            gc.enable()
        if timer is not None:
            timer.close()
        if core is not None:
            core.finish()
        if variant == "torch hooks only (no-op bodies)":
            for h in handles:
                h.remove()
        return times

    def burn() -> None:
        """Plain Python work, ~20 us when run hot in a loop (calibrated below)."""
        d: dict[str, float] = {}
        for i in range(burn_n):
            d[_KEYS[i % 8]] = d.get(_KEYS[i % 8], 0.0) + i

    burn_n = 200
    hot_us = min(timeit.repeat(burn, number=2000, repeat=5)) / 2000 * 1e6
    burn_n = max(1, int(burn_n * 20.0 / hot_us))
    hot_us = min(timeit.repeat(burn, number=2000, repeat=5)) / 2000 * 1e6
    burn_label = f"python burn {hot_us:.1f} us hot"

    variants = ["attach", "attach, torch events", "5 raw event records, no query", "core only, 5 marks, poll lag 2",
                "torch hooks only (no-op bodies)", burn_label]
    block("none")
    ratios, mratios, pcts = defaultdict(list), defaultdict(list), defaultdict(list)
    for _ in range(args.pairs):
        for v in variants:
            a, b = block("none"), block(v)
            ratios[v].append(sum(b) / sum(a))
            mratios[v].append(statistics.median(b) / statistics.median(a))
            pcts[v].append((statistics.median(b) / 1e3, sorted(b)[int(0.9 * len(b))] / 1e3, max(b) / 1e3))
            pcts["none"].append((statistics.median(a) / 1e3, sorted(a)[int(0.9 * len(a))] / 1e3, max(a) / 1e3))
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}; {args.pairs} pairs of {args.steps} steps; "
          "host us per step: p50 p90 max (median over blocks); overhead: median over pairs of the ratio of "
          "block time (throughput) [interquartile range], and of the per-step medians")
    for v in ["none", *variants]:
        p = [statistics.median(x[i] for x in pcts[v]) for i in range(3)]
        r = ""
        if v in ratios:
            q = statistics.quantiles(ratios[v], n=4)
            r = (f"{100 * (statistics.median(ratios[v]) - 1):+6.2f}% [{100 * (q[0] - 1):+.2f}, {100 * (q[2] - 1):+.2f}]"
                 f"  p50 ratio {100 * (statistics.median(mratios[v]) - 1):+6.2f}%")
        print(f"{v:34.34s} p50 {p[0]:8.1f}  p90 {p[1]:8.1f}  max {p[2]:9.1f}   {r}")


if __name__ == "__main__":
    main()
