"""DDP's exposed communication on one GPU, against the profiler's timeline: planted collectives of known length.

    PYTHONPATH=. python benchmarks/comm_truth.py [--steps 30] [--spin-ms 4] [--out FILE]

One process, NCCL, world size 1: DDP runs its real reducer, buckets and end-of-backward.  The "collective"
is the user's comm hook launching a spin kernel (``torch.cuda._sleep``) of known length on a side stream,
after the bucket's gradients, and returning a future that completes when the spin ends; DDP's
end-of-backward makes the compute stream wait for it, as for NCCL's own kernels.

- ``late``: the spin on the last bucket: nothing left to hide it, the wait is exposed.
- ``early``: the spin on the first bucket, with the rest of backward (long enough) after it: hidden.
- ``default``: no user hook: DDP's own average (its C++ hook) on NCCL, the split on the real path.
- ``view``: the same with ``gradient_as_bucket_view=True`` (no copy of the results into ``.grad``); ``late_view``
  and ``early_view`` likewise.
- ``bare``: the same model without DDP (phase-timer attached as ever): the step's scale without a reducer.

``backward.comm_wait`` is DDP's end-of-backward, less DDP's copies of each bucket's result into ``.grad``
(``gradient_as_bucket_view=False``, DDP's default), which phase-timer times on sampled backwards and leaves in
``backward``.  The table gives those copies' own device time (the kernels under DDP's ``copy_bucket_to_grad``
ranges) beside it.

The truth, per step, is the profiler's (Kineto) union-of-intervals rule: the communication kernels' time (the
spins, NCCL's) not overlapped by the union of the other kernels.  Two unions: the offline trace analyzers'
(compute kernels only: a memcpy is not compute there), and the compute stream's (its copies too: DDP's copies
into ``.grad`` are work the compute stream does while a collective runs, not a wait; phase-timer's
``backward.comm_wait`` is the compute stream's wait, so this is its truth).  With ``gradient_as_bucket_view=True``
there are no copies and the two agree.  Both are averaged over the same timed steps.  It also counts the
host-device syncs (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize) in the profiled steps:
there must be none.

The host cost is measured two ways on a launch-bound DDP (32 small layers, a bucket each): wall time a step
with and without the split (noisy at the µs scale), and each of the split's calls timed inside two nested
timers (the inner one times the call, the outer one the call and the inner timer: the call alone is about
``2 x inner - outer``), on the usual path (``lb_timed``) and on the host-paced one the loop keeps (``lb_paced``:
``paced.PacedSpans``' asked backwards, each part and each of its C calls timed; ``--calls-only`` runs these
alone).  A backward whose copies are timed (one in ``comm.ddp.COPY_EVERY``) is measured by making
every backward one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from phase_timer.measures import comm  # noqa: E402
import phase_timer.measures.comm.ddp  # noqa: E402,F401 - comm.ddp, comm.run below
import phase_timer.measures.comm.run  # noqa: E402,F401
from benchmarks.nccl_truth import back_to_back_us, device_intervals, exposed_us  # noqa: E402
from benchmarks.provenance import code_line  # noqa: E402

LINES: list[str] = []
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def say(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def cycles_per_ms() -> float:
    """The spin kernel's cycles a millisecond, measured (the clock varies by part).

    The kernel runs once untimed first (its module loads lazily, inside the first launch), then three timed runs;
    the largest rate is the clock's (a delay in a run only lowers it)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()  # deliberate: a calibration before the run
    rates = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        rates.append(10_000_000 / a.elapsed_time(b))
    return max(rates)


def spin_hook(which: str, cycles: int):
    side = torch.cuda.Stream()

    def hook(state, bucket):  # no annotations: DDP checks them
        buf = bucket.buffer()
        fut = torch.futures.Future(devices=[buf.device])
        planted = bucket.is_last() if which == "last" else bucket.index() == 0
        if planted:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(cycles)
                fut.set_result(buf)  # its events on the side stream, after the spin
        else:
            fut.set_result(buf)
        return fut

    return hook


class _Timed:
    """``target`` with ``names``' calls timed by ``timed(fn, name)`` (single timers, ``"engine."``-style keys), the
    rest read through; ``extra`` attributes set on the proxy (a core whose clock is timed)."""

    def __init__(self, target: object, names: tuple[str, ...], timed, **extra: object) -> None:  # noqa: ANN001
        self._target = target
        for name in names:
            setattr(self, name, timed(getattr(target, name), f"{type(target).__name__}.{name}"))
        for k, v in extra.items():
            setattr(self, k, v)

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)


def run(case: str, steps: int, spin_ms: float, cpm: float, width: int, depth: int, batch: int) -> dict:
    torch.manual_seed(0)
    body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).cuda()
    layer_mb = width * width * 4 / 2**20
    name, view = case, case == "view" or case.endswith("_view")
    case = case.removesuffix("_view")
    model = (nn.parallel.DistributedDataParallel(body, bucket_cap_mb=layer_mb * 1.05, gradient_as_bucket_view=view)
             if case != "bare" else body)
    profile = not case.startswith("lb")
    opt = torch.optim.SGD(body.parameters(), lr=1e-6)
    x = torch.randn(batch, width, device="cuda")
    data = [x] * steps
    warm = 5
    log_dir = tempfile.mkdtemp()
    timer = phase_timer.attach(model, opt, data, log_dir=log_dir, window=steps, warmup_steps=warm, mfu=False,
                               enabled=not case.endswith("off"))
    if case == "lb_core":  # phase-timer on, the split taken off: what the split alone costs a step
        for probe in timer.__dict__.pop("_comm"):
            probe.remove()
    # lb_timed: ns a call of the split's hook (0, inner timer; 2, outer) and of its final callback (1; 3).
    # lb_paced: ns a call, by name (inner and outer timer), of the host-paced path's parts (paced.PacedSpans)
    spent: list[list[int]] = [[], [], [], []]
    parts: dict[str, list[int]] = {}
    paced_probe = None
    if case in ("lb_timed", "lb_paced"):
        probe = timer._comm[0]

        def timed(fn, k):  # noqa: ANN001, ANN202
            into = spent[k] if isinstance(k, int) else parts.setdefault(k, [])

            def call(*args):  # noqa: ANN002, ANN202
                t = time.perf_counter_ns()
                out = fn(*args)
                into.append(time.perf_counter_ns() - t)
                return out

            return call

        def nested(fn, name):  # noqa: ANN001, ANN202
            return timed(timed(fn, name), name + "/outer")

        # the parameter's hook as armed (C: phase_timer._native.Arm), its queued switch too, each in two timers
        from phase_timer._native import Arm

        probe._handle.remove()
        if case == "lb_timed":
            start = timed(timed(probe._to_wait, 1), 3)
            hook = lambda armed: timed(timed(armed, 0), 2)  # noqa: E731
        else:  # instance attributes: the path calls them through self
            hook = lambda armed: nested(armed, "hook")  # noqa: E731
            for name in ("_paced_start", "_paced_end", "_settle", "_defer", "_decide", "_drop_deferred"):
                setattr(probe, name, nested(getattr(probe, name), name.strip("_")))
            probe._engine = _Timed(probe._engine, ("switch", "behind", "add_host"), timed)
            probe._core = _Timed(probe._core, (), timed, clock=_Timed(probe._core.clock, ("mark", "done", "release"),
                                                                         timed))
            at_optimizer = probe._at_optimizer
            pre, post = nested(lambda: at_optimizer(False), "opt_pre"), nested(lambda: at_optimizer(True), "opt_post")
            probe._at_optimizer = lambda is_post: post() if is_post else pre()
            start = probe._paced_start
            paced_probe = probe
        armed = Arm(probe._engine, "backward", model, "require_forward_param_sync", probe._queue_callback, start)
        probe._armed, probe._start = armed, start
        probe._handle = probe._param.register_post_accumulate_grad_hook(hook(armed))
    sampled = None
    if case == "lb_sampled":  # every synced backward's copies timed (the run's schedule: one in COPY_EVERY or more)
        sampled = timer._comm[0]
        host_ns = sampled.copy_host_ns  # the run's list (closing the timer starts a new one)
        sampled._armed.due = 1
        sampled._schedule = lambda due: setattr(sampled._armed, "due", 1)
    if case in ("late", "early"):
        model.register_comm_hook(None, spin_hook("last" if case == "late" else "first", int(spin_ms * cpm)))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    t_wall = []
    for i, xb in enumerate(timer.loader):
        if i == warm:
            torch.cuda.synchronize()  # the benchmark's: the profiled steps begin on an idle device
            if profile:
                prof.start()
            t0 = time.perf_counter()
        model(xb).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()  # the benchmark's
    t_wall = (time.perf_counter() - t0) / (steps - warm) * 1e3
    if profile:
        prof.stop()
    run_comm = comm.run.find(timer.core) if timer.core is not None else None
    paced = ((paced_probe.paced_steps, paced_probe.paced_waiting, paced_probe._paced)
             if paced_probe is not None else None)
    totals = timer.close()
    n = steps - warm
    truth = timeline(prof.events() if profile else [], n, ("spin", "sleep", "nccl"))  # the planted and the real
    copy_ms = run_comm.copy_ms if run_comm is not None else None
    sampled_us = sorted(host_ns)[len(host_ns) // 2] / 1e3 if sampled is not None else None
    wait = totals.phases.get("backward.comm_wait") if totals is not None else None
    mean = lambda p: totals.phases[p].mean if totals is not None and p in totals.phases else float("nan")  # noqa: E731
    return dict(
        case=name, steps=n, backward=mean("backward"), step=mean("step"),
        wait=wait.mean if wait is not None else None, truth=truth["exposed"] if profile else float("nan"),
        stream=truth["exposed_stream"] if profile else float("nan"), copy_ms=copy_ms,
        sampled_us=sampled_us,
        spin=truth["comm"], comm=run_comm.as_dict() if run_comm is not None else None, syncs=truth["syncs"],
        wall=t_wall, copies=truth["copies"] if profile else float("nan"),
        copies_run=truth["copies_run"] if profile else float("nan"),
        split_us=[sorted(v)[len(v) // 2] / 1e3 if v else 0.0 for v in spent],
        parts={k: (sorted(v)[len(v) // 2] / 1e3, len(v)) for k, v in parts.items() if v}, paced=paced,  # called parts
    )


def timeline(events: list, steps: int, comm_names: tuple[str, ...]) -> dict[str, float]:
    """A profile's truth, per step: ``exposed`` (ms of the communication kernels, those whose name holds one of
    ``comm_names``, outside the union of every compute kernel: the offline trace analyzers' rule), ``comm`` (their
    ms), ``copies`` (ms of the kernels under DDP's ``copy_bucket_to_grad``) and ``syncs`` (host-device syncs seen)."""
    # activities only: the GPU-side annotations (nccl:all_reduce over its kernel) would count a collective twice
    kernels = [(a, b, n.lower()) for a, b, n, kind in device_intervals(events) if kind != "annotation"]
    comm = [(a, b) for a, b, n in kernels if any(k in n for k in comm_names)]
    other = [(a, b, n) for a, b, n in kernels if not any(k in n for k in comm_names)]
    compute = exposed_us(comm, [(a, b) for a, b, n in other if "memcpy" not in n and "memset" not in n])
    stream = exposed_us(comm, [(a, b) for a, b, _ in other])
    copies = sum(e.device_time_total for e in events if e.name.endswith("copy_bucket_to_grad"))
    run = back_to_back_us([(a, b) for a, b, n in kernels if "dtod" in n])
    return dict(exposed=compute / 1e3 / steps, exposed_stream=stream / 1e3 / steps,
                comm=sum(b - a for a, b in comm) / 1e3 / steps, copies_run=run / 1e3 / steps,
                copies=copies / 1e3 / steps, syncs=sum(1 for e in events if e.name in SYNCS))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--spin-ms", type=float, default=4.0)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--cases", default="late,early,late_view,early_view,default,view,ddp_off,bare")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lb-steps", type=int, default=400)
    p.add_argument("--calls-only", action="store_true", help="only the split's calls' own host time (the usual path "
                   "and the host-paced one), no profiled case and no wall-time comparison")
    p.add_argument("--out")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    cpm = cycles_per_ms()
    say(code_line())
    say(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; DDP world 1 (NCCL); "
        + ("the split's calls alone (--calls-only)" if args.calls_only else
           f"{args.depth} x Linear({args.width}) fp32, batch {args.batch}, one bucket a layer; spin {args.spin_ms} ms; "
           f"{args.steps} steps, the last {args.steps - 5} timed and profiled"))
    if not args.calls_only:
        rows = [run(c, args.steps, args.spin_ms, cpm, args.width, args.depth, args.batch) for c in args.cases.split(",")]
        # Launch-bound (the host's cost shows): 32 small layers, a bucket each; DDP without phase-timer, with it
        # but the split taken off, and with both; interleaved, the median of the rounds' wall time a step.
        lb: dict[str, list[float]] = {"lb_off": [], "lb_core": [], "lb_on": [], "lb_sampled": []}
        sampled_us = []
        for _ in range(args.rounds):
            for c in lb:
                r = run(c, args.lb_steps, 0, cpm, 256, 32, 64)
                lb[c].append(r["wall"])
                if r["sampled_us"] is not None:
                    sampled_us.append(r["sampled_us"])
        say(f"{'case':11} {'comm_wait ms':>12} {'stream ms':>9} {'diff ms':>8} {'analyzers ms':>12} {'DDP copies ms':>13} "
            f"{'back to back':>12} "
            f"{'copies taken':>12} {'comm kernels ms':>15} {'collectives ms':>14} {'hidden':>7} {'backward ms':>11} "
            f"{'step ms':>8} {'wall ms':>8} {'syncs':>5}")
        for r in rows:
            c = r["comm"] or {}
            if r["case"].endswith("off"):
                r["backward"] = r["step"] = float("nan")
            wait = r["wait"]
            diff = f"{wait - r['stream']:+8.3f}" if wait is not None else f"{'-':>8}"
            taken = r["copy_ms"] if r["copy_ms"] is not None else float("nan")
            say(f"{r['case']:11} {wait if wait is not None else float('nan'):12.3f} {r['stream']:9.3f} {diff} "
                f"{r['truth']:12.3f} {r['copies']:13.3f} {r['copies_run']:12.3f} {taken:12.3f} {r['spin']:15.3f} "
                f"{c.get('collectives_ms', float('nan')):14.3f} {c.get('hidden_share', float('nan')):7.2f} "
                f"{r['backward']:11.3f} {r['step']:8.3f} {r['wall']:8.3f} {r['syncs']:5d}")
        med = {c: sorted(v)[len(v) // 2] for c, v in lb.items()}
        say(f"launch-bound DDP (32 x Linear(256), batch 64, 32 buckets), {args.lb_steps - 5} steps x {args.rounds} rounds, "
            f"median wall ms a step: without phase-timer {med['lb_off']:.4f}, with it but no split {med['lb_core']:.4f}, "
            f"with both {med['lb_on']:.4f}: the split {1e3 * (med['lb_on'] - med['lb_core']):+.1f} us a step, "
            f"everything phase-timer does {1e3 * (med['lb_on'] - med['lb_off']):+.1f} us; every backward's copies timed "
            f"{med['lb_sampled']:.4f}: a sampled backward {1e3 * (med['lb_sampled'] - med['lb_on']):+.1f} us")
        us = sorted(sampled_us)[len(sampled_us) // 2]
        say(f"a sampled end-of-backward's host time (its copies timed; DDP's own end-of-backward in), median of the rounds' "
            f"medians: {us:.0f} us; the next is {max(comm.ddp.COPY_EVERY, int(us * 1e3 / comm.ddp.COPY_BUDGET_NS))} synced "
            f"backwards later (at least {comm.ddp.COPY_EVERY}, and its host time / {comm.ddp.COPY_BUDGET_NS} ns): "
            f"{us / max(comm.ddp.COPY_EVERY, us * 1e3 / comm.ddp.COPY_BUDGET_NS):.2f} us a backward spread")
        for c, v in lb.items():
            say(f"  {c} rounds: {' '.join(f'{x:.4f}' for x in v)}")
    parts = [run("lb_timed", args.lb_steps, 0, cpm, 256, 32, 64)["split_us"] for _ in range(args.rounds)]
    alone = [2 * p[0] - p[2] + 2 * p[1] - p[3] for p in parts]  # the hook and the callback, each 2 x inner - outer
    k = sorted(range(len(parts)), key=lambda i: alone[i])[len(parts) // 2]
    hook, cb = parts[k][0], parts[k][1]
    say(f"the split's own host time a synced backward, each call inside two nested timers (medians of the calls; "
        f"the median round of {args.rounds}): the parameter's hook {hook:.1f} us (outer {parts[k][2]:.1f}), the "
        f"final callback that starts the wait {cb:.1f} us (outer {parts[k][3]:.1f}); inner timers {hook + cb:.1f} "
        f"us, the calls alone (2 x inner - outer) {alone[k]:.1f} us; rounds, alone: {' '.join(f'{a:.1f}' for a in alone)}")
    # The host-paced path (paced.PacedSpans), as a launch-bound loop keeps it (its device keeps pace): the start in
    # Python, its end, two optimizer hooks a step; each call alone (2 x inner - outer), beside the usual path's
    runs = [run("lb_paced", args.lb_steps, 0, cpm, 256, 32, 64) for _ in range(args.rounds)]

    def alone_us(r: dict, name: str) -> float:
        (inner, n), (outer, _) = r["parts"].get(name, (0.0, 0)), r["parts"].get(name + "/outer", (0.0, 0))
        return (2 * inner - outer) * n / max(1, r["parts"]["hook"][1])  # a synced backward's share

    top = ("hook", "paced_start", "paced_end", "opt_pre", "opt_post")
    totals_us = [sum(alone_us(r, n) for n in top) for r in runs]
    k2 = sorted(range(len(runs)), key=lambda i: totals_us[i])[len(runs) // 2]
    r = runs[k2]
    say(f"the host-paced path's own host time a synced backward (the same nested timers, each call alone, a synced "
        f"backward's share of its calls; the median round of {args.rounds}): "
        + ", ".join(f"{n} {alone_us(r, n):.1f} us ({r['parts'].get(n, (0, 0))[1]} calls)"
                    for n in (*top, "settle", "defer", "decide", "drop_deferred"))
        + "; the C calls inside (one timer each, medians, a synced backward's share): "
        + ", ".join(f"{n} {v[0] * v[1] / max(1, r['parts']['hook'][1]):.1f} us ({v[1]} calls)"
                    for n, v in sorted(r["parts"].items()) if "." in n)
        + f"; the path's calls {totals_us[k2]:.1f} us a step against the usual path's {alone[k]:.1f}: "
        f"{totals_us[k2] - alone[k]:+.1f} us; (corrected, waiting, on) at the end {r['paced']}; rounds: "
        + " ".join(f"{a:.1f}" for a in totals_us))
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
