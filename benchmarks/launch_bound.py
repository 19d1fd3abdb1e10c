"""phase-timer's overhead on the launch-bound model, resolved finely enough to read 1%.

    PYTHONPATH=. python benchmarks/launch_bound.py [--rounds 300] [--block 20] [--out FILE]

Why not long A/B runs: on a launch-bound loop the step time is the host's speed,
which drifts by several percent over seconds (turbo, neighbours on the host), so
two long runs of identical work differ by more than the 1% to be read.  Here
every round runs one short block of every variant, in a shuffled order, on one
warm model; each variant's overhead is the median over rounds of its block time
over the plain block of the same round.  Drift slower than a round cancels.

The timer is attached once (its writer thread, event file and pool live through
the run) and its hooks are installed for its blocks only.  Calibration: blocks
that burn a known amount of plain Python per step show how host time turns into
step time on this loop (1:1 when it is truly launch-bound).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import timeit
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
import phase_timer.timing.engine  # noqa: E402
from benchmarks.host_cost import print_and_save, python_engine  # noqa: E402
from benchmarks.models import LAUNCH_BOUND, Cycle, make_batches, make_model, plain_step  # noqa: E402
from phase_timer.timing.clock import make_clock  # noqa: E402
from phase_timer.measures.memory import Memory  # noqa: E402
from phase_timer.run.core import TimingCore  # noqa: E402
from phase_timer.outputs.sinks import open_event_file  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run only


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()
_KEYS = [f"k{i}" for i in range(8)]


def calibrated_burn(target_us: float) -> tuple[Callable[[], None], float]:
    """Plain Python work taking ``target_us`` per call when run hot; returns it and its measured cost."""
    n = 200

    def burn() -> None:
        d: dict[str, float] = {}
        for i in range(n):
            d[_KEYS[i % 8]] = d.get(_KEYS[i % 8], 0.0) + i

    for _ in range(2):
        hot_us = min(timeit.repeat(burn, number=2000, repeat=5)) / 2000 * 1e6
        n = max(1, round(n * target_us / hot_us))
    return burn, min(timeit.repeat(burn, number=2000, repeat=5)) / 2000 * 1e6


class Inside:
    """Host time spent inside wrapped functions, per name (the wrappers' own cost included: see ``calibrate``)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        #: Time inside the hooks that is not ours (what they wrap and call), subtracted and said apart.
        self.excluded: dict[str, int] = defaultdict(int)
        #: ns per call of the same wrapper around a C call that does nothing, in the same run (None: not measured).
        self.wrapper_ns: float | None = None

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        ns, calls, clock = self.ns, self.calls, time.perf_counter_ns

        def timed(*args: Any) -> Any:  # positional only: no keyword dict made at each call
            t0 = clock()
            try:
                return fn(*args)
            finally:
                ns[name] += clock() - t0
                calls[name] += 1

        return timed

    def calibrate(self, module: torch.nn.Module) -> Callable[[], None]:
        """Time the same wrapper around ``int()`` (a C call that does nothing) from a forward pre-hook of
        ``module``, in situ: its own cost per call.  Returns what to call at the end (removes the hook)."""
        calibration = Inside()
        timed_nothing = calibration.wrap(int, "x")

        def hook(module: Any, args: Any) -> None:
            timed_nothing()

        handle = module.register_forward_pre_hook(hook)

        def done() -> None:
            handle.remove()
            self.wrapper_ns = calibration.ns["x"] / max(1, calibration.calls["x"])

        return done

    def report(self, what: str, steps: int) -> list[str]:
        """The total per step, then each name's share of it (names with a dot are parts of the hooks, inside them)."""
        hooks = {k: v for k, v in self.ns.items() if "." not in k}
        total = sum(hooks.values()) / steps / 1e3
        lines = [f"host time inside {what}, per step over {steps} steps: {total:.1f} us"]
        lines += [f"    {name:36s} {ns / steps / 1e3:7.2f} us" for name, ns in hooks.items()]
        lines += [f"  not counted: {name} {ns / steps / 1e3:.2f} us" for name, ns in self.excluded.items()]
        if self.wrapper_ns is not None:
            per_step = sum(self.calls[k] for k in hooks) / steps
            own = self.wrapper_ns * per_step / 1e3
            lines += [f"  the timing wrapper's own cost: {self.wrapper_ns / 1e3:.2f} us a call (around an empty hook, "
                      f"this run) x {per_step:.1f} timed calls a step = {own:.1f} us",
                      f"the hooks less the timing wrapper's own cost: {total - own:.1f} us"]
        parts = {k: v for k, v in self.ns.items() if "." in k}
        if parts:
            lines.append("  of which (a separate run, each part timed too: ~0.1-0.2 us more per call)")
            lines += [f"    {name:36s} {ns / steps / 1e3:7.2f} us" for name, ns in parts.items()]
        return lines

    def parts(self, core: Any, bounds: Any = None) -> None:
        """Time the core's calls into its engine (marks, polls: the C engine) and its window writes too."""
        engine = core._engine
        proxy = _TimedEngine(engine, self)
        core._engine = proxy
        for name in ("phase", "relabel", "add_host", "end"):
            setattr(core, name, getattr(proxy, {"phase": "switch"}.get(name, name)))
        if bounds is not None and hasattr(bounds, "_hot"):  # the boundaries' own calls into the engine, timed too
            bounds._hot(proxy)
        core._consume = self.wrap(core._consume, "core._consume (windows, writes)")


class _TimedEngine:
    """An engine whose calls are timed under ``engine.<name>``; its properties pass through."""

    _CALLS = ("open", "switch", "end", "relabel", "add_host", "close", "poll", "in_flight", "newest_done", "behind",
              "discard")

    def __init__(self, engine: Any, inside: Inside) -> None:
        self._e = engine
        for name in self._CALLS:
            setattr(self, name, inside.wrap(getattr(engine, name), f"engine.{name}"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._e, name)


# Every body of the plain door's hooks; they are looked up on the instance when the
# hooks are installed or called, so instance attributes take effect.
_PLAIN_HOOK_BODIES = ("_fetch", "_on_batch", "_on_forward", "_backward_began", "_backward_ended", "_on_optimizer_end")


def host_inside(model: torch.nn.Module, opt: torch.optim.Optimizer, step: Callable[[Any], None], steps: int,
                parts: bool = False, calibrate: bool = False) -> Inside:
    """Host time inside the plain door's hook bodies, in a real loop (``parts``: the engine's calls timed too;
    ``calibrate``: the same timing wrapper around an empty forward pre-hook too, said apart: its own cost there)."""
    inside = Inside()
    done = inside.calibrate(model) if calibrate else None
    loader = Cycle(make_batches(LAUNCH_BOUND), steps)
    timer = phase_timer.attach(model, opt, loader, log_dir=tempfile.mkdtemp(), summary=False)
    timer.detach()
    for name in _PLAIN_HOOK_BODIES:
        setattr(timer, name, inside.wrap(getattr(timer, name), name))
    bounds = timer._bounds
    name = "on_optimizer_start" if hasattr(bounds, "on_optimizer_start") else "optimizer_start"  # an older tree's
    setattr(bounds, name, inside.wrap(getattr(bounds, name), "optimizer_start"))
    if parts:
        inside.parts(timer.core, bounds)
    timer._install()
    with timer:
        for batch in timer.loader:
            step(batch)
    assert timer.totals is not None and timer.totals.steps == steps - timer.config.warmup_steps
    if done is not None:
        done()
    return inside


def overhead_table(names: list[str], us: dict[str, list[float]], width: int) -> list[str]:
    """Each variant's median block time and its overhead over ``none``, round by round."""
    lines = [
        "per variant: median us/step over blocks; overhead = median over rounds of (block / plain block of the round) "
        "[interquartile range]; added = median over rounds of the per-step difference",
        f"{'variant':{width}s} {'us/step':>9s} {'overhead':>9s} {'IQR':>17s} {'added us':>9s}",
    ]
    base = us["none"]
    for name in names:
        vals = us[name]
        row = f"{name[:width]:{width}s} {statistics.median(vals):9.1f}"
        if name != "none":
            ratios = [v / b for v, b in zip(vals, base)]
            q = statistics.quantiles(ratios, n=4)
            added = statistics.median(v - b for v, b in zip(vals, base))
            row += f" {100 * (statistics.median(ratios) - 1):+8.2f}% [{100 * (q[0] - 1):+6.2f}, {100 * (q[2] - 1):+6.2f}] {added:+9.1f}"
        lines.append(row)
    return lines


class _PassThroughBackward:
    """``torch.autograd.backward`` wrapped by a function that only calls it; ``remove()`` puts it back."""

    def __init__(self) -> None:
        original = self._original = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        torch.autograd.backward = backward

    def remove(self) -> None:
        torch.autograd.backward = self._original


def noop_hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Callable[[], list[Any]]]:
    """The hooks the plain door uses, with bodies that do nothing else: each kind, and all."""
    parts: dict[str, Callable[[], list[Any]]] = {
        "forward pre-hook": lambda: [model.register_forward_pre_hook(lambda m, a: None)],
        "backward() wrapper": lambda: [_PassThroughBackward()],
        "optimizer pre + post hooks": lambda: [
            opt.register_step_pre_hook(lambda o, a, k: None),
            opt.register_step_post_hook(lambda o, a, k: None),
        ],
    }
    kinds = list(parts)
    parts["all of the plain door's"] = lambda: [h for kind in kinds for h in parts[kind]()]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--variants", default="all", help="comma-separated prefixes of the variants to run")
    ap.add_argument("--inside-steps", type=int, default=3000)
    ap.add_argument("--parts", action="store_true", help="also time the engine's calls inside the hooks (a second run)")
    ap.add_argument("--calibrate", action="store_true",
                    help="the in-hook run also times an empty forward pre-hook with the same wrapper (its own cost)")
    ap.add_argument("--inside-inline", action="store_true", help="the in-hook run with the C engine resolving inline")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = make_model(LAUNCH_BOUND, DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = plain_step(model, opt, DEV)
    batches = make_batches(LAUNCH_BOUND)
    loader = Cycle(batches, args.block)

    def make_timer() -> Any:
        timer = phase_timer.attach(model, opt, loader, log_dir=tempfile.mkdtemp(), summary=False, warmup_steps=0)
        timer.detach()  # hooks in for its own blocks only
        return timer

    timer = make_timer()
    with python_engine():
        timer_py = make_timer()
    threaded = getattr(phase_timer.timing.engine, "RESOLVER_THREAD", None)  # None: an older tree, which has no thread
    phase_timer.timing.engine.RESOLVER_THREAD = False
    timer_inline = make_timer()  # the C engine resolving at the poll, on the training thread
    phase_timer.timing.engine.RESOLVER_THREAD = threaded
    assert timer.core is not None and timer_py.core is not None
    clock = timer.core.clock
    engines = f"{type(timer.core._engine).__name__} / {type(timer_py.core._engine).__name__}"
    install_noop = noop_hooks(model, opt)
    burn10, burn10_us = calibrated_burn(10.0)
    burn20, burn20_us = calibrated_burn(20.0)

    def run_none() -> None:
        for batch in loader:
            step(batch)

    def attached(t: Any) -> Callable[[], None]:
        def run() -> None:
            t._install()
            try:
                for batch in t.loader:
                    step(batch)
            finally:
                t.detach()

        return run

    def core_only(lag: int) -> Callable[[], None]:
        sink = open_event_file(tempfile.mkdtemp(), per_step=False)
        clock = make_clock(DEV)  # memory per phase listens, as on a door's core
        core = cores[lag] = TimingCore(clock, [sink], window=50, warmup_steps=0, max_pending=64, poll_lag=lag,
                                       measures=Memory.listening(clock))

        def run() -> None:
            for i, batch in enumerate(loader):
                core.begin_step(i, "h2d")
                core.phase("forward")
                core.phase("backward")
                core.phase("optimizer")
                step(batch)
                core.end()
                core.close()

        return run

    cores: dict[int, TimingCore] = {}

    def run_marks() -> None:
        mark, release = clock.mark, clock.release
        for batch in loader:
            marks = [mark(), mark(), mark(), mark()]
            step(batch)
            marks += [mark(), mark()]
            release(marks)

    def with_hooks(install: Callable[[], list[Any]]) -> Callable[[], None]:
        def run() -> None:
            handles = install()
            try:
                for batch in loader:
                    step(batch)
            finally:
                for h in handles:
                    h.remove()

        return run

    def with_burn(burn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for batch in loader:
                burn()
                step(batch)

        return run

    variants: dict[str, Callable[[], None]] = {
        "none": run_none,
        "attach (phase-timer default)": attached(timer),
        "attach, Python engine": attached(timer_py),
        "attach, resolved inline (no thread)": attached(timer_inline),
        "core only (begin, 3 switches, end, close)": core_only(2),
        "core only, poll lag 0": core_only(0),
        "core only, poll lag 8": core_only(8),
        f"6 marks only ({type(clock).__name__})": run_marks,
        **{f"no-op hooks: {k}": with_hooks(v) for k, v in install_noop.items()},
        f"python burn {burn10_us:.1f} us": with_burn(burn10),
        f"python burn {burn20_us:.1f} us": with_burn(burn20),
    }
    if args.variants != "all":
        keep = args.variants.split(",")
        variants = {k: v for k, v in variants.items() if k == "none" or any(k.startswith(p) for p in keep)}

    def block(fn: Callable[[], None]) -> float:
        sync()  # benchmark boundary, outside the timed block
        t0 = time.perf_counter_ns()
        fn()
        sync()  # benchmark boundary: the block's last step done
        return (time.perf_counter_ns() - t0) / args.block / 1e3

    for fn in variants.values():  # warm every path
        for _ in range(3):
            block(fn)
    rng = random.Random(0)
    names = list(variants)
    us: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        rng.shuffle(names)
        for name in names:
            us[name].append(block(variants[name]))
    timer.close()
    timer_py.close()
    timer_inline.close()
    for core in cores.values():
        core.finish()

    lines = [
        f"device {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu'}  torch {torch.__version__}  {time.strftime('%Y-%m-%d')}",
        f"{args.rounds} rounds x {len(variants)} blocks of {args.block} steps, shuffled each round; clock {type(clock).__name__}; engines {engines}",
        *(overhead_table(list(variants), us, width=40) if args.rounds else []),
    ]
    if args.inside_inline:
        phase_timer.timing.engine.RESOLVER_THREAD = False
    inside = host_inside(model, opt, step, args.inside_steps, calibrate=args.calibrate)
    if args.parts:  # a second run with the parts timed too: the first run's hook totals stay unbiased
        detail = host_inside(model, opt, step, args.inside_steps, parts=True)
        inside.ns.update({k: v for k, v in detail.ns.items() if "." in k})
    what = "the plain door's hook bodies" + (" (resolved inline, no thread)" if args.inside_inline else "")
    lines += inside.report(what, args.inside_steps)
    print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
