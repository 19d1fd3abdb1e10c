"""Exposed communication on real NCCL, every rank and each step, against the profiler on the same steps.

    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/comm_nccl.py [--out FILE] [--json FILE]
    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 benchmarks/comm_nccl.py --cpu   # gloo: a smoke run

Each case is its own model and ``attach()`` (the plain door, ``per_step=True``).  The model is a GPT-2-class LM
(``--width 768 --depth 12``: 148 parameter tensors, ~124M parameters, SDPA attention, bf16 autocast, fused
AdamW, ``--batch 16 x --seq 1024`` tokens a rank: enough for the device to run behind the host, as training
runs; with 8 x 1024 on an H200 the backward is paced by the host, see ``docs/benchmarks.md``):

- ``ddp_default``: DDP's defaults (25 MB buckets, ``gradient_as_bucket_view=False``: DDP copies each result into
  ``.grad`` in its end-of-backward; phase-timer takes its estimate of those copies off the wait).
- ``ddp_view``: the same with ``gradient_as_bucket_view=True`` (no copies).
- ``ddp_one``: one bucket (``bucket_cap_mb`` above the gradients): the all-reduce starts after backward's last
  gradient and is all exposed.
- ``ddp_late``: DDP's defaults, rank 1 sleeps 15 ms before each forward: rank 0 waits for it every step.
- ``ddp_straggler``: rank 1 sleeps 20 ms inside forward: ``RANK_STRAGGLER`` must name rank 1 (its step equals the
  others', the all-reduce hides it; the others' wait names it).
- ``data_straggler``: rank 1's loader sleeps 20 ms a batch: ``RANK_STRAGGLER`` names rank 1, in ``data_wait``: medium
  where the sleep reaches the devices (the others wait in their all-reduce), info where a device queue deeper than
  20 ms hides it (``straggler_severity``).
- ``eval_rank0``: DDP's defaults, rank 0 alone evaluates (no-grad forwards, untimed) after every 6th step, as
  nanoGPT's ``train.py`` does: the other rank waits for it in its next all-reduce.
- ``fsdp2``: ``fully_shard`` on every block and the root: forward's and backward's waits.
- ``copies10`` / ``copies200``: DDP defaults on 10 and 200 parameter tensors (Linear layers): the copies'
  estimate against the profiler's copy time under DDP's ``copy_bucket_to_grad``.
- ``paced200``: the 200 tensors on 2 x 128 tokens a rank (a host-paced backward: the device runs out of work while
  the host launches DDP's copies), rank 1 sleeping 20 ms before every third forward: rank 0's host-paced spans,
  some of them waits for rank 1 (the host-paced correction's two questions, ``paced.PacedSpans``).
- ``host200``: the 200 tensors on 2 x 128 tokens a rank, no rank sleeping: every rank steadily host-paced, each
  backward asked (``paced.PacedSpans``), and the rank whose host is slower waited for by the other.
- ``paced200_sync``: the same, each rank reading its loss (``loss.item()``, a logged loss) between ``backward()``
  and the optimizer step: the host waits for the device there, so the second question's "done" tells nothing,
  and rank 0's waits stay whole (``paced.PacedSpans._decide``'s host-late rule).

The truth (``nccl_truth.py``), per rank and step, is the profiler's union-of-intervals rule on the same steps (a
marker kernel at each iteration's start cuts them): NCCL's kernels outside every other kernel, memcpy and memset
on that rank (``exposed_stream``); the analyzers' rule (compute kernels only) beside it.  The profiler records
device activity only (CUPTI): with CPU activity on (``--profile-cpu``) each launch costs the host ~3x more, the
steps turn host-bound, and the union rule then counts the NCCL kernels that run beside the compute stream's idle
gaps (the host's, not the network's) as exposed, and DDP's copies as launched at the profiler's pace.  DDP's
copies are the device-to-device memcpy of the step.  Rank zero prints one
row per case, rank and step, then a summary per case and rank (the largest per-step gap, and how many steps are
within 0.1 ms or 2%, and how many backwards lost how much to the host-paced spans' correction,
``ddp.DdpComm._settle``), and the verdicts.  ``--cpu``: gloo, a tiny model, no profiler: that the script runs,
splits and adds up (``tests/measures/comm/test_comm.py`` runs it).

``--launches`` adds the blocked rule (``nccl_truth.per_step_blocked``): the queued rule's exposed time only where
the compute stream has its next kernel queued (from the host's launch call of the kernel that ends each of its
gaps, and the device's launch latency after it: ``nccl_truth.LAUNCH_LATENCY_US``), not where it idles for the host,
as FSDP2's steps do between groups; the summary line adds the rule with no latency.  The launch calls are the CUDA
runtime's and driver's, which the profiler's CUDA activity records already (matched to their kernels by
correlation id): the flag turns on no CPU activity (``--profile-cpu`` does, and combines with it).  Each row then
ends in ``blocked`` and its diff, and each case and rank gets a summary line of its own.  ``--stream-waits`` (with
``--launches``) has the profiler record CUPTI's synchronization records too (torch's experimental
``enable_cuda_sync_events``) and the summary line adds the rule with the compute stream's own waits on events
counted as queued work (``waited``: a wait on a collective queued while the host has yet to launch what follows).

``--span-kernels`` (a diagnosis) brackets each wait phase-timer marks with two tiny kernels on the stream of its
marks (``bitwise_not`` before the span's start, ``logical_not`` after its end): FSDP2's (``span_kernels``) and DDP's
(``DdpSpanKernels``: the switches of the bound split's engine, and ``backward()``'s return on the usual path).  Per
profiled step, ``nccl_truth.exposed_where`` then splits the queued rule's exposed time into inside and outside the
spans, and places the outside part in the step's phases (phase-timer's own per-step rows of ``forward``,
``backward`` and ``optimizer``, laid end to end from the step's marker; the rest ``between``) with its longest
intervals and the kernels either side.  On ``--cpu`` (no profiler) each DDP case says only how many begin and end
kernels ran against phase-timer's steps with a wait.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.nccl_truth import (  # noqa: E402
    device_activities, device_intervals, exposed_where, launch_times, per_step, per_step_blocked, within)
from benchmarks.provenance import code_line  # noqa: E402
from phase_timer.phases import COMM_PARTS, share_base, whole_phases  # noqa: E402

CASES = ("ddp_default", "ddp_view", "ddp_one", "ddp_late", "ddp_straggler", "data_straggler", "eval_rank0",
         "fsdp2", "copies10", "copies200", "paced200", "paced200_sync", "host200")
MARKER = "pt_step_marker"
#: --span-kernels: a tiny kernel before and after each wait phase-timer marks, FSDP2's and DDP's (a diagnosis: which
#: exposed collectives fall outside phase-timer's spans; the two kernels are work too, ~2 us each)
SPAN_BEGIN, SPAN_END = "bitwise_not", "logical_not"


def span_kernels(device: torch.device) -> None:
    """Wrap phase-timer's FSDP2 spans with the two kernels (each on the stream the marks go to)."""
    from phase_timer.measures.comm import fsdp

    between = fsdp._between_marks
    tiny = torch.zeros(1, dtype=torch.int32, device=device)

    def marked(engine, phase, fn, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        tiny.bitwise_not_()

        def inner(*a2, **kw2):  # noqa: ANN002, ANN003, ANN202
            try:
                return fn(*a2, **kw2)
            finally:
                tiny.logical_not_()

        return between(engine, phase, inner, *a, **kw)

    fsdp._between_marks = marked


class DdpSpanKernels:
    """--span-kernels on a DDP case: the two kernels at the ends of phase-timer's DDP span, on the compute stream.

    The span is the engine's ``backward.comm_wait`` phase: it begins where the engine switches to it from
    ``backward`` (a final callback after backward's compute, before DDP's end-of-backward) and ends where it
    switches out of it: in ``_joined``/``_paced_end`` (after DDP's end-of-backward: back to ``backward``) or, on
    the usual path, at ``backward()``'s return (to ``optimizer``, in the door's own backward wrapper).  Every
    switch of the module's split goes through ``probe._engine`` (``_split`` on a sampled or composed hook's
    backward, ``_paced_start``, ``_joined``, ``_paced_end``) but the usual path's, whose start is a ``partial`` of
    the engine's own ``switch`` (``probe._to_wait``) queued by the native ``Arm``: so ``probe._engine`` becomes this
    object (everything but ``switch`` forwarded), and ``probe._to_wait`` (and the start now queued, ``probe._start``
    and ``Arm.callback``, where they are it) ``switch(WAIT)`` through it.  ``switch`` launches the begin kernel right
    before the engine's switch from ``backward`` to the wait and the end kernel right after a switch out of it; a
    span still open when the loop's ``backward()`` returns (the usual path) ends at that return, where the loop
    calls :meth:`backward_returned` first thing: nothing is queued on the device between the door's switch there
    and the end kernel.  So the kernels bracket the span on every synced backward, sampled ones too, and each adds
    its ~2 us to ``backward`` (the begin kernel) or to the phase after the span (the end kernel), never to the span.

    What it changes: the usual path's start becomes one Python frame (a few us of host time before the span, not in
    it); a host-paced module's question (``engine.behind()`` right after the span's end, ``DdpComm._settle``) is
    asked after the end kernel's launch, a few us later.  What it misses: a rebinding of the probe (``bind``: a second ``attach``) takes the wrap off; a span the
    core switches out of by any other door than the loop's ``backward()`` return (a ``Tensor.backward`` inside
    another door, a backward that raises: the end kernel then comes at the loop's next call to
    :meth:`backward_returned`, late)."""

    def __init__(self, probe, device: torch.device) -> None:  # noqa: ANN001
        from phase_timer.measures.comm.ddp import Arm
        from phase_timer.measures.comm.run import WAIT
        from phase_timer.phases import BACKWARD

        self.real, self.wait, self.backward = probe._engine, WAIT, BACKWARD
        self.tiny = torch.zeros(1, dtype=torch.int32, device=device)
        self.open = False
        self.begins = self.ends = 0  # kernels launched
        self.odd = 0  # a begin kernel with no span, a span with none, one opened twice (none expected)
        self.at_return = 0  # spans ended at backward()'s return (the rest in the split's own callbacks)
        old = probe._to_wait
        new = functools.partial(self.switch, WAIT)
        probe._engine, probe._to_wait = self, new  # the split's own switches, from here on, come through switch
        if probe._start is old:
            probe._start = new
        if Arm is not None and isinstance(probe._armed, Arm) and probe._armed.callback is old:
            probe._armed.callback = new

    def __getattr__(self, name: str):  # noqa: ANN204 - the engine's current, behind, add_host...
        return getattr(self.real, name)

    def switch(self, phase: str) -> None:
        real = self.real
        before = real.current
        opening = phase == self.wait and before == self.backward
        if opening:
            self.tiny.bitwise_not_()  # right before the wait's start mark
            self.begins += 1
        real.switch(phase)
        now = real.current
        entered = before != self.wait and now == self.wait
        self.odd += entered != opening  # a begin kernel with no span, or a span with none (never expected)
        if entered:
            self.odd += self.open
            self.open = True
        elif before == self.wait and now != self.wait:
            self._close()

    def _close(self) -> None:
        self.tiny.logical_not_()  # right after the wait's end mark
        self.open = False
        self.ends += 1

    def backward_returned(self) -> None:
        """The loop's ``backward()`` returned: a span still open ended there (the door switched to ``optimizer``)."""
        if self.open:
            if self.real.current == self.wait:  # still in the wait: not ended (never expected)
                self.odd += 1
            else:
                self.at_return += 1
                self._close()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = max(1, d // 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, depth: int, seq: int, slow_s: float) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2's
        self.slow_s = slow_s

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.slow_s:
            time.sleep(self.slow_s)
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Linears(nn.Module):
    """``n`` parameter tensors: n/2 Linear layers (weight and bias), a token embedding in front (2 more)."""

    def __init__(self, vocab: int, d: int, n: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(max(1, (n - 2) // 2)))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return self.head(x)


class SlowLoader:
    def __init__(self, data: list, slow_s: float) -> None:
        self.data, self.slow_s = data, slow_s

    def __iter__(self):  # noqa: ANN204
        for x in self.data:
            if self.slow_s:
                time.sleep(self.slow_s)
            yield x


def build(case: str, args: argparse.Namespace, device: torch.device, rank: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    if case.startswith(("copies", "paced", "host")):
        net: nn.Module = Linears(args.vocab, args.width, int("".join(c for c in case if c.isdigit())))
    else:
        late = rank == 1 and case in ("ddp_late", "ddp_straggler")
        net = GPT(args.vocab, args.width, args.depth, args.seq, (0.015 if case == "ddp_late" else 0.02) if late else 0.0)
    net = net.to(device)
    if case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        return net, fully_shard(net)
    grads_mb = sum(p.numel() for p in net.parameters()) * 4 / 2**20
    return net, nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=2 * grads_mb if case == "ddp_one" else 25, gradient_as_bucket_view=case == "ddp_view")


def run(case: str, args: argparse.Namespace, device: torch.device) -> dict:
    rank = dist.get_rank()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    net, model = build(case, args, device, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(rank)
    batch, seq = (2, 128) if case.startswith(("paced", "host")) else (args.batch, args.seq)  # a host-paced backward
    data = [torch.randint(0, args.vocab, (batch, seq), generator=g) for _ in range(4)]
    data = SlowLoader([data[i % 4] for i in range(args.steps)], 0.02 if case == "data_straggler" and rank == 1 else 0)
    timer = phase_timer.attach(model, opt, data, log_dir=tempfile.mkdtemp(), window=args.window,
                               warmup_steps=args.warmup, copy_to_device=True, summary=False, per_step=True,
                               modules=args.modules)
    core = timer.core
    steps: dict[int, tuple[dict, dict]] = {}  # phase-timer's step -> (its phases before DDP's copies came off, after)
    consume = core._consume

    def consumed(results):  # noqa: ANN001, ANN202 - every rank's per-step values, as the core resolves them
        got = [(item[1], item[2], dict(item[2])) for item in results or () if item[0] == "step"]
        consume(results)
        for step, ms, raw in got:
            steps[step] = (raw, dict(ms))

    core._consume = consumed
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if args.profile_cpu
                                                           else [])
    sync = {"experimental_config": torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)} \
        if args.stream_waits and device.type == "cuda" else {}
    prof = None if device.type != "cuda" else torch.profiler.profile(activities=activities, **sync)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    first = args.steps - args.profiled
    probe = next(iter(getattr(timer, "_comm", None) or ()), None)
    ddp_marks = DdpSpanKernels(probe, device) if args.span_kernels and probe is not None and hasattr(probe, "_armed") \
        else None
    paced_at: list[int] = []  # the paced path's corrected backwards before each iteration (and after the last)
    for i, tokens in enumerate(timer.loader):
        paced_at.append(getattr(probe, "paced_steps", 0))
        if args.sample_at is not None and i == args.sample_at - 1 and probe is not None and hasattr(probe, "_schedule"):
            probe._schedule(2)  # the next synced backward after this one has its copies timed (in the trace)
        if i == max(0, first - args.prewarm) and prof is not None:
            torch.cuda.synchronize()  # the benchmark's: the profiled steps begin on an idle device
            prof.start()
        if prof is not None and i >= first:
            torch.cuda._sleep(100)  # the marker kernel: step i begins here on the compute stream
        if case.startswith("paced") and rank == 1 and i % 3 == 0:
            time.sleep(0.02)  # rank 0 waits for this one in its next all-reduce
        with autocast:
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        if ddp_marks is not None:
            ddp_marks.backward_returned()  # first thing: the usual path's span ended at backward()'s return
        if case == "paced200_sync":
            loss.item()  # the benchmark's: a logged loss before the step, the host waits for the device
        opt.step()
        opt.zero_grad(set_to_none=True)
        if case == "eval_rank0" and rank == 0 and i % 6 == 5:
            model.eval()
            with torch.no_grad(), autocast:
                for _ in range(args.eval_batches):
                    model(tokens)
            model.train()
    paced_at.append(getattr(probe, "paced_steps", 0))
    if prof is not None:
        torch.cuda.synchronize()  # the benchmark's
        prof.stop()
    from phase_timer.measures.comm import run as comm_run

    run_comm = comm_run.find(core)
    copy_ms = run_comm.copy_ms if run_comm is not None else None
    copy_low_ms = getattr(run_comm, "copy_low_ms", None)  # where a step waited (run.less_copies)
    copy_buckets = bucket_samples(run_comm) or []
    # the host-paced spans' correction (paced.PacedSpans): backwards corrected, ms taken in all, on at the end, and
    # the spans the second question kept whole (the device still in them at the optimizer step)
    paced = ([probe.paced_steps, round(probe.paced_ms, 3), probe._paced, getattr(probe, "paced_waiting", None)]
             if probe is not None and hasattr(probe, "paced_steps") else None)
    plan = getattr(timer._bounds, "flops", None)  # the FLOP plan the boundaries count with (None: none)
    counted = plan is not None and getattr(plan, "counted", None)
    pt_peak = core.memory.peak_allocated_mb if core.memory is not None else None
    totals = timer.close()
    torch_peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    truth: list[dict] = []
    where: list[dict] = []
    blocked: list[dict] = []
    blocked_start: list[dict] = []
    blocked_now: list[dict] = []  # the blocked rule with each window opened at the launch call's end (no latency)
    if prof is not None:
        events = prof.events()
        intervals = device_intervals(events)
        truth = per_step(intervals, ("nccl",), "spin_kernel")
        if args.launches:
            activities = device_activities(events)
            blocked = per_step_blocked(activities, launch_times(events), ("nccl",), "spin_kernel")
            blocked_start = per_step_blocked(activities, launch_times(events, at="start"), ("nccl",), "spin_kernel")
            blocked_now = per_step_blocked(activities, launch_times(events), ("nccl",), "spin_kernel", latency=0.0)
        if args.span_kernels:  # with phase-timer's own rows of the profiled steps: where the outside part lies
            where = exposed_where(intervals, SPAN_BEGIN, SPAN_END,
                                  phases=[steps.get(first + k, ({}, None))[1] for k in range(args.profiled)])
        if args.dump:  # the raw material of every rule, to study offline (a diagnosis)
            dump(args.dump, case, rank, events, steps, first, args.profiled)
        if args.trace_dir and rank in (0, 1) and case in args.trace_cases.split(","):
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"{case}_r{rank}.json"))
    rows = []
    for k in range(args.profiled):
        step = first + k
        raw, final = steps.get(step, ({}, {}))
        t = truth[k] if k < len(truth) else {}
        bl = blocked[k] if k < len(blocked) else {}
        rows.append(dict(step=step, wait=sum(final.get(p, 0.0) for p in COMM_PARTS),
                         raw=sum(raw.get(p, 0.0) for p in COMM_PARTS), fwd=final.get("forward.comm_wait"),
                         step_ms=final.get("step"), period=final.get("period"), data_wait=final.get("data_wait"),
                         truth=t.get("exposed_queued"), strict=t.get("exposed_stream"), analyzers=t.get("exposed"),
                         comm=t.get("comm"),
                         prof_copies=t.get("copies"), prof_copies_run=t.get("copies_run"),
                         prof_copies_queued=t.get("copies_queued"),
                         blocked=bl.get("blocked"), blocked_unmatched=bl.get("unmatched"), waited=bl.get("waited"),
                         blocked_at_call_start=blocked_start[k]["blocked"] if k < len(blocked_start) else None,
                         blocked_no_latency=blocked_now[k]["blocked"] if k < len(blocked_now) else None,
                         blocked_less_own=bl.get("less_own"),
                         paced=paced_at[step + 1] - paced_at[step] if step + 1 < len(paced_at) else None))
    d = timer.diagnosis
    findings = [d, *d.secondary] if d is not None else []
    straggler = next((f for f in findings if f.kind == "RANK_STRAGGLER"), None)
    phases = {p: t.mean for p, t in totals.phases.items()} if totals is not None else {}
    inside = [p for p in whole_phases(phases) if share_base(p) == "step" and p != "step"]
    return dict(case=case, rank=rank, rows=rows, copy_ms=copy_ms, copy_low_ms=copy_low_ms, copy_buckets=copy_buckets,
                paced=paced, where=where,
                span_kernels=[ddp_marks.begins, ddp_marks.ends, ddp_marks.at_return, ddp_marks.odd,
                              sum(COMM_PARTS.keys() & raw.keys() != set() for raw, _ in steps.values()), len(steps)]
                if ddp_marks is not None else None,
                kinds=[f.kind for f in findings],
                mean_step=phases.get("step"), mean_period=phases.get("period"), pt_peak=pt_peak,
                torch_peak=torch_peak, counted=str(counted), means={k: round(v, 3) for k, v in phases.items()},
                straggler=(straggler.why + " | " + " | ".join(straggler.next)) if straggler is not None else None,
                findings=[f"{f.kind} ({f.severity}): {f.why}" for f in findings],
                forward_wait=phases.get("forward.comm_wait"), backward_wait=phases.get("backward.comm_wait"),
                adds_up=abs(sum(phases[p] for p in inside) - phases["step"]) <= 1e-6 * phases["step"],
                straggler_rank=straggler.evidence.get("rank") if straggler is not None else None,
                straggler_severity=straggler.severity if straggler is not None else None,
                straggler_phase=straggler.evidence.get("phase") if straggler is not None else None,
                straggler_by=straggler.evidence.get("by") if straggler is not None else None,
                straggler_pauses=straggler.evidence.get("pauses") if straggler is not None else None)


def dump(folder: str, case: str, rank: int, events, steps: dict, first: int, profiled: int) -> None:  # noqa: ANN001
    """--dump: this rank's device activities (kernels, memcpy, memset, CUPTI's sync records; each with its stream
    and correlation id), the host's launch calls (correlation id -> call start and end, µs) and phase-timer's
    per-step rows (before DDP's copies came off, and after) of the profiled steps, as ``{case}_r{rank}.json.gz``."""
    import gzip

    os.makedirs(folder, exist_ok=True)
    starts = launch_times(events, "start")
    data = dict(case=case, rank=rank, activities=device_activities(events),
                launches={k: [starts[k], v] for k, v in launch_times(events).items()},
                rows=[list(steps.get(first + k, ({}, {}))) for k in range(profiled)], first=first)
    with gzip.open(os.path.join(folder, f"{case}_r{rank}.json.gz"), "wt") as fh:
        json.dump(data, fh)


def bucket_samples(run_comm) -> list | None:  # noqa: ANN001
    """Each bucket's last copies samples (ms), over the DDP modules: those the device ran queued, and those it caught
    up with the host in (None: no communication measure)."""
    if run_comm is None:
        return None
    return [[[round(v, 3) for v in queued], [round(v, 3) for v in caught]]
            for buckets in getattr(run_comm, "_copy_buckets", {}).values() for queued, caught in buckets]


def fmt(v: float | None, w: int = 8) -> str:
    return f"{'-':>{w}}" if v is None else f"{v:{w}.3f}"


def blocked_diff(row: dict) -> float | None:
    """phase-timer's reading less the blocked rule's, ms (None without the rule)."""
    return None if row.get("blocked") is None else row["wait"] - row["blocked"]


def timed(row: dict) -> bool:
    """Whether phase-timer timed the step (a row of its own): a module sample's step and the one after it are
    untimed (``modules=True``), and are left out of the counts, which say how many."""
    return row["step_ms"] is not None


def untimed_text(r: dict) -> str:
    steps = [row["step"] for row in r["rows"] if not timed(row)]
    return f" ({len(steps)} untimed, left out: steps {','.join(map(str, steps))})" if steps else ""


def blocked_line(r: dict) -> str:
    """One case's and rank's summary under the blocked rule: its steps within 0.1 ms or 2% of the rule, the largest
    gap, the rule's mean against the queued rule's, the part counted in gaps whose kernel had no launch found, the
    rule with each launch at its call's start, the rule with no launch latency, and the rule less the compute stream's
    own gaps (``nccl_truth.own_gaps``), each with its steps within."""
    rows = [row for row in r["rows"] if row.get("blocked") is not None and timed(row)]
    ok = sum(within(row["wait"], row["blocked"]) for row in rows)
    worst = max((blocked_diff(row) for row in rows), key=abs, default=0.0)
    n = len(rows) or 1
    mean = {k: sum(row.get(k) or 0.0 for row in rows) / n for k in ("blocked", "truth", "blocked_unmatched",
                                                                     "blocked_at_call_start", "blocked_no_latency")}
    near = sum(within(row["wait"], row["blocked_no_latency"])
               for row in rows if row.get("blocked_no_latency") is not None)
    line = (f"{r['case']:14} rank {r['rank']}: {ok}/{len(rows)} steps within 0.1 ms or 2% of the blocked rule, "
            f"largest gap {worst:+.3f} ms; blocked {mean['blocked']:.3f} ms a step vs queued {mean['truth']:.3f}; in "
            f"gaps with no launch found {mean['blocked_unmatched']:.3f}; with launches at their call's start "
            f"{mean['blocked_at_call_start']:.3f}; with no launch latency {mean['blocked_no_latency']:.3f} ({near}/"
            f"{len(rows)} within 0.1 ms or 2%)")
    own = [row for row in rows if row.get("blocked_less_own") is not None]
    if own:
        near = sum(within(row["wait"], row["blocked_less_own"]) for row in own)
        line += (f"; less the compute stream's own gaps {sum(row['blocked_less_own'] for row in own) / len(own):.3f} "
                 f"({near}/{len(own)} steps within 0.1 ms or 2%)")
    waited = [row for row in rows if row.get("waited") is not None]
    if waited:
        near = sum(within(row["wait"], row["waited"]) for row in waited)
        line += (f"; with the compute stream's waits queued {sum(row['waited'] for row in waited) / len(waited):.3f} "
                 f"({near}/{len(waited)} steps within 0.1 ms or 2%)")
    return line


def copies_text(r: dict) -> str:
    """The copies' estimate against the profiler's copies (medians over the profiled steps): their own time, back to
    back on the steps where they all ran queued (what the wait's span holds on such a step: their own time and a
    queued stream's launch gaps, which the queued rule counts as work), and back to back over every step."""
    def median(rows: list[dict], key: str) -> float | None:
        vals = sorted(row[key] for row in rows if row.get(key))
        return vals[len(vals) // 2] if vals else None

    rows = r["rows"]
    queued = [row for row in rows if (row.get("prof_copies_queued") or 0) >= 0.95]
    waited = f" ({r['copy_low_ms']:.3f} where a step waited)" if r.get("copy_low_ms") is not None else ""
    return (f"copies estimate {fmt(r['copy_ms'])}{waited} vs profiler's own {fmt(median(rows, 'prof_copies'))}, "
            "back to back "
            f"{fmt(median(queued, 'prof_copies_run'))} on the {len(queued)} steps they ran queued, "
            f"{fmt(median(rows, 'prof_copies_run'))} over all (ms, medians)"
            + "".join(f"; bucket {k}: queued samples {q or '-'}, caught-up {c or '-'}"
                      for k, (q, c) in enumerate(r.get("copy_buckets") or [])))


def paced_text(paced: list | None) -> str:
    """The host-paced spans' correction over the run: how many backwards lost how much of their wait."""
    if not paced:
        return "host-paced correction: none"
    n, ms, on, waiting = (list(paced) + [None])[:4]
    kept = f", {waiting} kept whole (still in the span at the optimizer step)" if waiting is not None else ""
    return (f"host-paced correction on {n} backwards, {ms:.3f} ms in all ({'on' if on else 'off'} at the "
            f"end){kept}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="gloo, a tiny model, no profiler: a smoke run")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profiled", type=int, default=12)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--profile-cpu", action="store_true", help="CPU activity too (slows the host ~3x a launch: the "
                   "steps turn host-bound and the union rule then counts NCCL beside the idle gaps as exposed)")
    p.add_argument("--launches", action="store_true", help="the blocked rule beside the others: the queued rule "
                   "where the compute stream has its next kernel queued (the host's launch calls, which the CUDA "
                   "activity records already; no CPU activity)")
    p.add_argument("--stream-waits", action="store_true", help="with --launches: CUPTI's synchronization records "
                   "too (enable_cuda_sync_events), and the blocked rule with the compute stream's waits counted as "
                   "queued work")
    p.add_argument("--sample-at", type=int, help="time DDP's copies on this step's backward too (a traced one)")
    p.add_argument("--modules", action="store_true", help="which module on (modules=True; off by default): its "
                   "sampled steps and the steps after them are untimed, the same steps on every rank")
    p.add_argument("--span-kernels", action="store_true", help="a diagnosis: exposed NCCL inside and outside "
                   "phase-timer's FSDP2 and DDP spans, per step, and where the outside part lies (a tiny kernel "
                   "marks each span's ends on the trace; --cpu: the kernels' count alone, no profiler)")
    p.add_argument("--prewarm", type=int, default=0, help="start the profiler this many steps before the first "
                   "compared one (no marker there, so none is compared): CUPTI's start slows the host for a few steps, "
                   "and a device that catches up with a slowed host reads that host time in its span")
    p.add_argument("--dump", help="a folder: each case's and rank's device activities, launch calls and phase-timer "
                   "rows of the profiled steps, gzipped json (a diagnosis, read offline)")
    p.add_argument("--trace-dir")
    p.add_argument("--trace-cases", default="")
    p.add_argument("--out")
    p.add_argument("--json")
    args = p.parse_args()
    args.launches = args.launches or args.stream_waits
    if args.cpu:
        args.width, args.depth, args.vocab, args.batch, args.seq = 64, 2, 128, 4, 16
        args.steps, args.warmup, args.profiled, args.window, args.eval_batches = 30, 3, 4, 5, 150
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.span_kernels:
        span_kernels(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", device_id=device if device.type == "cuda" else None)
    results = []
    for case in args.cases.split(","):
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, run(case, args, device))
        results += every
        if dist.get_rank() == 0:
            print(f"# done {case}", flush=True)
    if dist.get_rank() == 0:
        lines = [code_line(), f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (gloo)'}; torch "
                 f"{torch.__version__}; world {dist.get_world_size()}; GPT width {args.width} x {args.depth} blocks, "
                 f"batch {args.batch} x {args.seq} tokens a rank; {args.steps} steps, the last {args.profiled} "
                 "profiled; each row one step of one rank",
                 "comm_wait: forward.comm_wait + backward.comm_wait (before cp: DDP's copies not taken off); queued: the "
                 "union rule with the compute stream's launch gaps (<= 3 us) filled; strict: the union rule as is; "
                 "analyzers: compute kernels only; nccl: the collectives' union; copies, run: DDP's copies (device-to-"
                 "device memcpy), their own time and back to back; all ms"
                 + ("; blocked: the queued rule where the compute stream has its next kernel queued (launched by the "
                    "host: from the launch call's end and the device's launch latency, nccl_truth.LAUNCH_LATENCY_US), "
                    "not where it idles for the host" if args.launches else "")
                 + "; paced: the backwards whose span the host-paced path corrected in the step (paced.PacedSpans)",
                 f"{'case':14} {'rank':>4} {'step':>4} {'comm_wait':>9} {'before cp':>9} {'queued':>8} "
                 f"{'diff':>8} {'strict':>8} {'diff':>8} {'analyzers':>9} {'nccl':>8} {'copies':>8} {'run':>8} "
                 f"{'step':>8} {'period':>8} {'data_wait':>9}"
                 + (f" {'blocked':>8} {'diff':>8}" if args.launches else "") + f" {'paced':>6}"]
        summary = []
        blocked_summary = []
        for r in results:
            ok = strict_ok = n = 0
            worst = 0.0
            for row in r["rows"]:
                diff = None if row["truth"] is None else row["wait"] - row["truth"]
                sdiff = None if row["strict"] is None else row["wait"] - row["strict"]
                if diff is not None and timed(row):
                    n += 1
                    ok += within(row["wait"], row["truth"])
                    strict_ok += within(row["wait"], row["strict"])
                    worst = diff if abs(diff) > abs(worst) else worst
                lines.append(f"{r['case']:14} {r['rank']:4d} {row['step']:4d} {fmt(row['wait'], 9)} "
                             f"{fmt(row['raw'], 9)} {fmt(row['truth'])} {fmt(diff)} {fmt(row['strict'])} "
                             f"{fmt(sdiff)} {fmt(row['analyzers'], 9)} "
                             f"{fmt(row['comm'])} {fmt(row['prof_copies'])} {fmt(row.get('prof_copies_run'))} {fmt(row['step_ms'])} "
                             f"{fmt(row['period'])} {fmt(row['data_wait'], 9)}"
                             + (f" {fmt(row['blocked'])} {fmt(blocked_diff(row))}" if args.launches else "")
                             + f" {'-' if row.get('paced') is None else row['paced']:>6}")
            over = sum(1 for row in r["rows"] if timed(row) and row["period"] is not None
                       and row["step_ms"] > row["period"])
            summary.append(f"{r['case']:14} rank {r['rank']}: {ok}/{n} steps within 0.1 ms or 2% of the queued rule "
                           f"({strict_ok}/{n} of the strict){untimed_text(r)}, largest gap {worst:+.3f} ms; {copies_text(r)}; "
                           f"{paced_text(r.get('paced'))}; "
                           f"steps with step > period: "
                           f"{over}; mean step {fmt(r['mean_step'])} period {fmt(r['mean_period'])}; "
                           f"verdicts {','.join(r['kinds'])}")
            if args.launches:
                blocked_summary.append(blocked_line(r))
        lines += ["", *summary, ""]
        if args.launches:
            lines += [*blocked_summary, ""]
        lines += [f"findings ({r['case']}, rank {r['rank']}): " + " || ".join(r["findings"]) for r in results]
        lines += [f"span kernels ({r['case']}, rank {r['rank']}): {b} begin and {e} end kernels at phase-timer's DDP "
                  f"spans' ends ({ret} of the ends at backward()'s return, the others in the split's callbacks), "
                  f"{odd} spans or kernels unpaired; {split} of phase-timer's {rows} per-step rows hold a wait"
                  for r in results if r.get("span_kernels") for b, e, ret, odd, split, rows in [r["span_kernels"]]]
        lines += [f"where ({r['case']}, rank {r['rank']}, step {first}): exposed (queued rule) inside phase-timer's "
                  f"spans {w['inside']:.3f} ms, outside {w['outside']:.3f} ms in {w['n_outside']} intervals, by "
                  f"collective {({k: round(v, 3) for k, v in w['kinds'].items()})}, by phase "
                  f"{({k: round(v, 3) for k, v in w['by_phase'].items()})}, the device idle after "
                  f"{w['then_idle']:.3f} ms of it; the longest (ms, phase, work before, after): {w['top']}"
                  for r in results for first, w in zip((row['step'] for row in r['rows']), r['where'])]
        lines += [f"memory ({r['case']}, rank {r['rank']}): phase-timer's peak {fmt(r['pt_peak'])} MB, torch's "
                  f"{fmt(r['torch_peak'])} MB; FLOPs counted here: {r['counted']}; means {r['means']}" for r in results]
        print("\n".join(lines), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")
        print("RESULT " + json.dumps(results), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
