"""Host time phase-timer spends per step, measured directly (no training around it).

Times, on the CUDA device, the primitives (DESIGN.md's table) and the core's whole
per-step path: begin + a host phase + 3 phase switches + the step's end + the close
at the next fetch (which polls and resolves the step that finished: 6 marks), plus
the amortized cost of writing a window to TensorBoard; with the C engine (the
default) and the Python one, on the native clock and torch's events.

    python benchmarks/host_cost.py [--steps 20000] [--out FILE]
    python benchmarks/host_cost.py --host-clock [--out FILE]     # no GPU needed

``--host-clock`` times only the core step on the host clock (the C engine, no driver
calls): what the Python and C around the driver calls cost, on any machine.  It also
runs against the previous release's ``phase_timer`` (``PYTHONPATH`` chooses), whose
core closes a step with ``end_step()``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import contextlib

import torch

import phase_timer.timing.engine
from phase_timer.timing.clock import CudaClock, HostClock, NativeCudaClock
from phase_timer.measures.memory import Memory
from phase_timer.run.core import TimingCore
from phase_timer.outputs.sinks import BackgroundSink, SummaryWriterSink, open_event_file


def print_and_save(text: str, path: str | None) -> None:
    """Print a benchmark's table; also write it to ``path`` (a small text file for results/)."""
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


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
        out[f"{name}: 5 marks + release, per mark"] = per_call_us(lambda: clock.release([mark(), mark(), mark(), mark(), mark()]), n) / 5
        marks = [mark() for _ in range(5)]
        torch.cuda.synchronize()
        out[f"{name}.done()"] = per_call_us(lambda: clock.done(marks[-1]), n)
        out[f"{name}.spans(5 marks)"] = per_call_us(lambda: clock.spans(marks), n)
    return out


def clocks() -> list:
    """The clocks to compare: the native one (if built) and torch's events."""
    return ([NativeCudaClock()] if NativeCudaClock is not None else []) + [CudaClock()]


@contextlib.contextmanager
def python_engine():
    """The Python engine even where the C one would be chosen (what the previous release ran)."""
    steps = phase_timer.timing.engine.Steps
    phase_timer.timing.engine.Steps = None
    try:
        yield
    finally:
        phase_timer.timing.engine.Steps = steps


def engine_calls(n: int) -> dict[str, float]:
    """The C engine's calls one by one, on the native clock and on the host clock (no CUDA)."""
    from phase_timer.timing.clock import HostClock
    from phase_timer.timing.engine import Steps, native_steps

    out: dict[str, float] = {}
    if Steps is None or NativeCudaClock is None:
        return out
    for name, clock in (("native clock", NativeCudaClock()), ("host clock", HostClock())):
        eng = native_steps(clock if name == "native clock" else time.perf_counter_ns, 50, 64)

        def open_close() -> None:
            eng.open(0, "h2d")
            eng.close(-1.0)
            eng.poll()

        def six() -> None:
            eng.open(0, "h2d")
            eng.switch("forward")
            eng.switch("backward")
            eng.switch("optimizer")
            eng.end()
            eng.close(-1.0)
            eng.poll()

        for _ in range(200):
            six()
        torch.cuda.synchronize()
        out[f"Steps ({name}): open + close + poll"] = per_call_us(open_close, n)
        out[f"Steps ({name}): open + 3 switches + end + close + poll"] = per_call_us(six, n)
        eng.drain()
    return out


def core_step(n: int, sink: str, window: int, clock_type: type, engine: str = "C") -> float:
    """Per step: begin, 3 switches, end, close (poll + resolve + stats + amortized window write)."""
    sinks: list = []
    tmp = tempfile.mkdtemp()
    if sink == "event file (default)":
        sinks.append(open_event_file(tmp, per_step=False))
    elif sink == "user's SummaryWriter":
        from torch.utils.tensorboard import SummaryWriter

        sinks.append(BackgroundSink(SummaryWriterSink(SummaryWriter(tmp), owned=True), "tensorboard"))
    with python_engine() if engine == "Python" else contextlib.nullcontext():
        clock = clock_type()  # memory per phase listens, as on a door's core
        core = TimingCore(clock, sinks, window=window, warmup_steps=0, max_pending=64, measures=Memory.listening(clock))
    assert (type(core._engine).__name__ == "PyEngine") == (engine == "Python" or clock_type is CudaClock)
    cuda = clock_type is not HostClock
    x = torch.randn(256, 256, device="cuda") if cuda else None
    state = {"i": 0}
    # The previous release closed a step with end_step(): no separate end (5 marks a step).
    end, close = (core.end, core.close) if hasattr(core, "close") else (lambda: None, core.end_step)

    def step() -> None:
        i = state["i"] = state["i"] + 1
        core.begin_step(i, "h2d")
        core.add_host("data_wait", 0.1)
        core.phase("forward")
        core.phase("backward")
        core.phase("optimizer")
        end()  # the step ends (its last optimizer step)
        close()  # the next fetch: the time between steps ends

    for _ in range(200):  # warm the pool
        step()
    if cuda:
        torch.cuda.synchronize()
        # A little device work per step, so the events complete while the host runs.
        x.mul_(1.0)
    us = per_call_us(step, n)
    core.finish()
    return us


def sampling_rows(n: int, clock_type: type, repeats: int = 5) -> list[str]:
    """What the diagnosis's samples cost: a whole step through the boundaries, every step sampled or none.

    Modes: ``off`` (nothing sampled, memory off), ``counts`` (off, and the door's ``count_batch`` every step:
    throughput's samples and tokens and a FLOP count carried, as every step pays with a batch), ``self-timing`` (every step's own host time timed, as one
    step in ~96 is), ``in flight`` (every close counts the steps in flight, as one in 16 does, on a
    CUDA clock), ``memory`` (every step reads the allocator's counters at its five boundaries, as one
    in ~128 does after the first ones, on a CUDA clock).  A sampled step's extra cost over ``off``, divided by its gap, is what each step
    pays on average.  A little device work per step lets the device finish each step soon, so
    counting the steps in flight takes its query path (the dearer one).
    """
    import phase_timer.run.boundaries as b
    import phase_timer.measures.memory as mm
    from phase_timer.run.boundaries import Boundaries

    cuda = clock_type is not HostClock
    x = torch.randn(64, 64, device="cuda") if cuda else None
    gaps = {"self-timing": sum(b.SAMPLE_GAP) / 2, "in flight": b.FLIGHT_EVERY, "memory": sum(mm.SPARSE_GAP) / 2}
    names = ("SAMPLE_GAP", "DENSE_SAMPLES", "FLIGHT_EVERY", "FLIGHT_DENSE_STEPS")

    def run(mode: str) -> float:
        saved = {k: getattr(b, k) for k in names}
        b.DENSE_SAMPLES = b.FLIGHT_DENSE_STEPS = 0  # every step in the mode's way, or (almost) none
        b.SAMPLE_GAP = (1, 1) if mode == "self-timing" else (10**9, 10**9)
        b.FLIGHT_EVERY = 1 if mode == "in flight" else 10**9
        dense, mm.DENSE = mm.DENSE, 10**9  # memory: every step read (in its mode)
        try:
            clock = clock_type()
            core = TimingCore(clock, [], window=50, warmup_steps=0, max_pending=64,
                              measures=Memory.listening(clock) if mode == "memory" else [])
            bounds = Boundaries(core)
            state = {"i": 0}
            count = None
            if mode == "counts":  # the steady state of throughput and FLOPs: a shape counted before, carried
                from phase_timer.measures.flops import StepFlops
                from phase_timer.signature import signature
                from phase_timer.measures.step_flops import FlopPlan
                from phase_timer.measures.throughput import BatchCounter

                batch = (torch.randint(0, 100, (8, 128)), torch.randint(0, 100, (8, 128)))
                bounds.counter = BatchCounter()  # what start_core's measures give the boundaries
                bounds.flops = FlopPlan("bench", given=None, peak_tflops=1.0, device_name=None)
                bounds.flops.carried[signature(batch)] = FlopPlan.carry(StepFlops({"forward": 1e12, "backward": 2e12},
                                                                               "counted"))
                count = bounds.count_batch

            def step() -> None:
                i = state["i"] = state["i"] + 1
                bounds.on_fetch()  # the calls the doors make (in C where built: phase_timer/native/fast.c)
                bounds.on_batch(i, 0.1)
                if count is not None:
                    count(batch)  # the door's, after the batch: samples, tokens, the signature, FLOPs carried
                bounds.on_copied()
                if x is not None:
                    x.mul_(1.0)
                bounds.on_backward_start()
                bounds.on_backward_end(False)
                bounds.on_optimizer_start()
                bounds.on_step_end()

            for _ in range(200):
                step()
            us = per_call_us(step, n, repeats=3)
            core.finish()
            return us
        finally:
            mm.DENSE = dense
            for k, v in saved.items():
                setattr(b, k, v)

    modes = ("off", "counts", "self-timing", "in flight", "memory") if cuda else ("off", "counts", "self-timing")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats):  # interleaved
        for m in modes:
            runs[m].append(run(m))
    med = {m: statistics.median(v) for m, v in runs.items()}
    lines = [f"a step through the boundaries ({clock_type.__name__}, C engine), {repeats} interleaved runs, median "
             "(min-max); amortized = extra per sampled step / its mean gap"]
    for k in modes:
        extra = med[k] - med["off"]
        amort = "" if k == "off" else (f"   extra {extra:6.2f} us every step (throughput and FLOPs from the batch's "
                                       "shapes)" if k == "counts" else f"   extra {extra:6.2f} us a sampled step / "
                                       f"{gaps[k]:.0f} = amortized {extra / gaps[k]:5.2f} us/step")
        lines.append(f"  {k:26s} {med[k]:7.2f} us ({min(runs[k]):.2f}-{max(runs[k]):.2f}){amort}")
    lines += schedule_rows({k: med[k] - med["off"] for k in modes if k not in ("off", "counts")})
    return lines


def schedule_rows(extra_us: dict[str, float]) -> list[str]:
    """The schedule's cost by run length: dense at first (a verdict from 20 steps), sparse later."""
    import phase_timer.run.boundaries as b

    import phase_timer.measures.memory as mm

    def expected(timed: int) -> tuple[float, float, float]:
        """Sampled steps, counted closes and memory steps within ``timed`` timed steps (sparse gaps at their mean).

        Memory steps are counted from the first step begun: the dense ones fall mostly in the warm-up (5 steps)."""
        dense_end = (sum(b.DENSE_GAP) / 2) * b.DENSE_SAMPLES
        samples = min(b.DENSE_SAMPLES, timed / (sum(b.DENSE_GAP) / 2)) + max(0.0, timed - dense_end) / (sum(b.SAMPLE_GAP) / 2)
        flights = min(timed, b.FLIGHT_DENSE_STEPS) // 2 + max(0, timed - b.FLIGHT_DENSE_STEPS) // b.FLIGHT_EVERY
        begun = timed + 5
        medium = (mm.MEDIUM - mm.DENSE) * sum(mm.MEDIUM_GAP) / 2
        mem = min(begun, mm.DENSE) + min(max(0, begun - mm.DENSE), medium) / (sum(mm.MEDIUM_GAP) / 2) + max(
            0.0, begun - mm.DENSE - medium) / (sum(mm.SPARSE_GAP) / 2)
        return samples, flights, mem

    lines = ["the schedule (first 8 sampled steps 2-4 apart, then 48-144; in flight every 2nd close to step 32, then "
             "every 16th; memory: the first 8 steps begun, then 4-12 apart to 16, then 64-192): samples, counts, memory "
             "steps and amortized cost by timed steps (warm-up 5)"]
    for timed in (20, 50, 100, 1_000, 10_000, 100_000):
        samples, flights, mem = expected(timed)
        cost = (samples * extra_us.get("self-timing", 0.0) + flights * extra_us.get("in flight", 0.0)
                + mem * extra_us.get("memory", 0.0)) / timed
        lines.append(f"  {timed:>7d} steps: {samples:6.1f} sampled, {flights:5d} in-flight counts, {mem:6.1f} memory "
                     f"steps, amortized {cost:5.2f} us/step")
    return lines


def host_clock_rows(n: int, repeats: int = 5) -> list[str]:
    """The core step on the host clock, C engine, five runs each: min and median."""
    import os

    import phase_timer

    lines = [f"phase_timer from {os.path.dirname(phase_timer.__file__)}  torch {torch.__version__}  "
             f"{time.strftime('%Y-%m-%d')}", f"core step on the host clock, C engine, {n} steps, {repeats} runs: min / median"]
    for sink in ("none", "event file (default)"):
        runs = [core_step(n, sink, 50, HostClock, "C") for _ in range(repeats)]
        lines.append(f"{sink:24s} {min(runs):6.2f} / {statistics.median(runs):6.2f} us")
    try:
        lines += sampling_rows(n, HostClock)
    except ImportError:  # the previous release: no sampled steps
        pass
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--host-clock", action="store_true", help="only the core step on the host clock (no GPU)")
    args = parser.parse_args()
    if args.host_clock:
        print_and_save("\n".join(host_clock_rows(args.steps)), args.out)
        return
    rows = primitives(args.steps)
    rows.update(engine_calls(args.steps))

    rows["core step, C engine, HostClock, none"] = [core_step(args.steps, "none", 50, HostClock, "C")]
    combos = [("C", NativeCudaClock)] if NativeCudaClock is not None else []
    combos += [("Python", NativeCudaClock)] if NativeCudaClock is not None else []
    combos += [("Python", CudaClock)]
    for _ in range(2):  # twice, interleaved: the spread shows the noise
        for engine, clock_type in combos:
            for sink in ("none", "event file (default)", "user's SummaryWriter"):
                key = f"core step, {engine} engine, {clock_type.__name__}, {sink}"
                rows.setdefault(key, []).append(core_step(args.steps, sink, 50, clock_type, engine))
    lines = [f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}"]
    lines.append("core step: begin + add_host + 3 switches + end + close (6 marks), window 50; two runs, interleaved")
    lines += [f"{k:72s} " + " ".join(f"{x:8.2f}" for x in (v if isinstance(v, list) else [v])) + " us" for k, v in rows.items()]
    if NativeCudaClock is not None:
        lines += sampling_rows(args.steps, NativeCudaClock)
    print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
