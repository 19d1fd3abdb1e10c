"""What the live file (``phase_timer_live.json``) costs rank zero's writer thread, per window.

    PYTHONPATH=. python benchmarks/live_file.py [--steps 400] [--window 20] [--out FILE]

A plain CPU loop (a small MLP, ``attach()``) runs ``--steps`` steps with a window of ``--window``; its core then
holds a real run's totals and signals.  Timed on this thread, as the writer thread runs them:

- ``live_view``: ``TimingCore.live_view()``, the verdict so far (``diagnose`` over the run's totals and signals)
  and the own cost;
- ``write``: ``LiveFile.write`` of one window's scalars (the run's last window's), which rewrites the file
  (JSON, a temporary file and a rename into a local folder) with ``live_view`` in it;
- ``write_no_state``: the same without ``live_view``: the file alone.

The writer thread holds the GIL while it runs them, so that time is the training thread's too when the two meet:
the figure is µs a window, and µs a step spread over the window.  Nothing of it runs on the training thread,
which puts the window's scalars (made for the other sinks anyway) on a queue: one ``SimpleQueue.put``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, ".")

import torch  # noqa: E402

from benchmarks.host_cost import print_and_save  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phase_timer  # noqa: E402
from benchmarks.provenance import code_line  # noqa: E402
from phase_timer.outputs.live import INTERVAL_S, LiveFile  # noqa: E402


def run_core(steps: int, window: int, log_dir: str):
    """A finished plain run's core (its totals, signals and context intact) and its last window's scalars."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(steps * 16, 32), torch.randn(steps * 16, 1))
    seen: dict = {}
    timer = phase_timer.attach(model, opt, DataLoader(data, batch_size=16), window=window, log_dir=log_dir,
                               summary=False, sinks=[lambda step, values: seen.update(values)])
    core = timer.core
    with timer:
        for x, y in timer.loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return core, {k: v for k, v in seen.items() if k.startswith(("phase_time/", "phase_timer/", "throughput/"))}


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        core, scalars = run_core(args.steps, args.window, os.path.join(d, "run"))
        core.diagnosis = None  # the verdict so far, as during the run (the end's is kept otherwise)
        with_state = LiveFile(d, core.live_view, interval_s=0.0)  # every call writes: one write's cost
        without = LiveFile(os.path.join(d, "bare"), interval_s=0.0)
        rows = [("live_view", median_us(core.live_view, args.repeat)),
                ("write", median_us(lambda: with_state.write(args.steps, scalars), args.repeat)),
                ("write_no_state", median_us(lambda: without.write(args.steps, scalars), args.repeat))]
        size = os.path.getsize(with_state.path)
    lines = [code_line(),
             f"# CPU ({os.cpu_count()} cores, Python {sys.version.split()[0]}, torch {torch.__version__}); a plain run of "
             f"{args.steps} steps, window {args.window}; {len(scalars)} scalars a window; the file {size} bytes; "
             f"median of {args.repeat} calls",
             f"# the file is written at most once every {INTERVAL_S:g} s while the run goes on (and once at the end): "
             "a write's cost bounds the writer thread's time a second, whatever the windows' rate",
             f"{'what':<16}{'us a write':>11}{'us a second, at most':>22}{'share of one core':>19}"]
    lines += [f"{name:<16}{us:>11.1f}{us / INTERVAL_S:>22.1f}{us / INTERVAL_S / 1e4:>18.3f}%" for name, us in rows]
    print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
