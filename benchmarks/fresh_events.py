"""Host cost of reading timing events the first time (query, elapsed) against reading them again.

    PYTHONPATH=. python benchmarks/fresh_events.py [--n 3000]

The primitives table times ``elapsed`` on events it has already read; a training step
reads fresh ones.  This times each call on events recorded a moment earlier.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phase_timer.clock import CudaClock, NativeCudaClock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    args = ap.parse_args()
    pc = time.perf_counter_ns
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for clock in [c for c in (NativeCudaClock() if NativeCudaClock else None, CudaClock()) if c is not None]:
        cols: dict[str, list[float]] = {k: [] for k in ("5 marks", "done, fresh", "done, again", "spans(5), fresh", "spans(5), again")}
        for _ in range(args.n):
            t0 = pc()
            ms = [clock.mark() for _ in range(5)]
            t1 = pc()
            torch.cuda.synchronize()  # benchmark: the events complete before they are read
            t2 = pc()
            clock.done(ms[-1])
            t3 = pc()
            clock.done(ms[-1])
            t4 = pc()
            clock.spans(ms)
            t5 = pc()
            clock.spans(ms)
            t6 = pc()
            clock.release(ms)
            for k, dt in zip(cols, (t1 - t0, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                cols[k].append(dt / 1e3)
        print(type(clock).__name__ + ": median us  " + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in cols.items()))
    steady(args.n * 5)


def steady(n: int) -> None:
    """The C engine's step (5 marks, poll) in a steady loop: by poll lag, with and without a kernel per step."""
    from phase_timer.engine import Steps

    if Steps is None or NativeCudaClock is None:
        return
    x = torch.randn(64, 64, device="cuda")
    for kernel in (False, True):
        for lag in (0, 2, 8, 32):
            eng = Steps(NativeCudaClock(), 50, 64, lag, 4, False)

            def step() -> None:
                eng.open(0, "h2d")
                eng.switch("forward")
                eng.switch("backward")
                if kernel:
                    x.add_(1.0)
                eng.switch("optimizer")
                eng.close(-1.0)
                eng.poll()

            for _ in range(500):
                step()
            runs = []
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    step()
                runs.append((time.perf_counter_ns() - t0) / n / 1e3)
            eng.drain()
            print(f"Steps step, lag {lag:2d}, {'a kernel per step' if kernel else 'no kernel        '}: {statistics.median(runs):6.2f} us")
    runs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            x.add_(1.0)
        runs.append((time.perf_counter_ns() - t0) / n / 1e3)
    print(f"the kernel alone: {statistics.median(runs):6.2f} us")


if __name__ == "__main__":
    main()
