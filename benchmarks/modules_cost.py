"""What which-module costs: a sampled step's host time, the amortized cost a step, and a GPU-bound run's overhead.

    PYTHONPATH=. python benchmarks/modules_cost.py [--layers 12] [--width 768] [--seq 1024] [--batch 8]
                                                   [--steps 300] [--reps 30] [--out FILE] [--cost-only]
    PYTHONPATH=. python benchmarks/modules_cost.py --cpu --layers 12 --width 64 --seq 32 --batch 2 --vocab 1024 \
        --cost-only   # the CPU proxy (host clock)

A GPT-2-124M-class model (``--layers 12 --width 768``, vocabulary 50,257, tied head; the default tree: 12 blocks
as one row with their ``ln_1``/``attn``/``ln_2``/``mlp``, ``wte``, ``wpe``, ``ln_f``, ``lm_head``: 65 modules in 5
groups), bf16 autocast on either device.

1. **A sample's host time** (``sampled_step_cost``): the host's time to issue one training step (forward, backward,
   optimizer; no wait for the device in it) with a sample's hooks on less the same without, the median of
   interleaved pairs' differences, per group of rows (a sample hooks one group; whole cycles of them); on the CPU
   the thread's CPU time with one intra-op thread (a shared host's other processes do not count), on a GPU host the
   wall clock.  The hooks' registration and removal and the marks' read are in it (``ModuleTimes.begin``/``close``/
   ``window``).  A sample's figure is the mean over the groups, with (CUDA) one in ``ACT_EVERY`` of a group's samples
   reading the allocator.  Amortized: over a run of ``RUN_STEPS`` (10,000) steps, its dense samples and its sparse
   ones by the measure's own schedule (``amortized_us_per_step``), and over the mean gap alone
   (``amortized_long_us``).  On the CPU, ``gpu_estimate_*`` adds what a GPU host pays and the CPU does not: each
   mark's event record (``GPU_MARK_US``) and the allocator's reads (``GPU_READ_US``).
2. **Where it goes** (``breakdown``): each part of a step (begin, forward, backward, optimizer, close, the read)
   with a sample's hooks less without, the mean over the groups.
3. **A GPU-bound run's overhead**: ``attach()`` runs of ``--steps`` steps with ``modules=True`` and
   ``modules=False``, interleaved three times each; each run's mean ``period`` on the device's clock.
   The cost target: an ordinary step unchanged, ≤ 5 µs a step amortized, ≤ 0.3% of a GPU-bound step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, ".")

import torch  # noqa: E402

from benchmarks.host_cost import print_and_save  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's layout: ``transformer.{wte, wpe, h, ln_f}`` and a tied ``lm_head``."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257, seq: int = 1024) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width), wpe=nn.Embedding(seq, width),
            h=nn.ModuleList(Block(width, heads) for _ in range(layers)), ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


def setup(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.device]:
    device = torch.device("cpu" if args.cpu else "cuda")
    heads = max(1, args.width // 64)
    model = GPT(args.layers, args.width, heads, args.vocab, args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    return model, opt, idx, device


def issue(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, device: torch.device) -> None:
    """One training step, bf16 autocast on either device (the CPU's graph then holds the casts' nodes a GPU's does)."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(idx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


#: The run the amortized figure assumes: its dense samples and its sparse ones over this many steps.
RUN_STEPS = 10_000
#: A GPU host's extra time per mark (a CUDA event's record) and per allocator read, which a CPU run does not pay:
#: the CPU figure's GPU estimate (the marks and reads each sample takes, times these).
GPU_MARK_US = 2.5
GPU_READ_US = 15.0


def samples_in(steps: int, dense: int, warmup: int = 0) -> int:
    """The steps of a ``steps``-step run a measure with ``dense`` dense samples samples (its own schedule)."""
    import random

    from phase_timer.measures import modules

    rng, due, n = random.Random(modules.SEED), warmup + 2, 0
    while due <= steps:
        n += 1
        due += modules.DENSE_GAP if n <= dense else rng.randint(*modules.GAP)
    return n


def _now(device: torch.device):
    """The benchmark's clock: on the CPU this thread's CPU time (one intra-op thread: the work is this thread's, and
    another process on a shared host's cores does not count), on a GPU host the wall clock."""
    if device.type == "cuda":
        return time.perf_counter_ns
    torch.set_num_threads(1)
    return time.thread_time_ns


def _gc_clock(stop: list[int] | None = None) -> list[int]:
    """The garbage collector's wall time, summed in ``[0]`` by a ``gc.callbacks`` entry while it is on (``stop``: take
    that clock's entry off)."""
    import gc

    if stop is not None:
        gc.callbacks[:] = [c for c in gc.callbacks if getattr(c, "clock", None) is not stop]
        return stop
    total = [0, 0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            total[1] = time.perf_counter_ns()
        else:
            total[0] += time.perf_counter_ns() - total[1]

    on_gc.clock = total  # type: ignore[attr-defined]
    gc.callbacks.append(on_gc)
    return total


def sampled_step_cost(args: argparse.Namespace) -> dict[str, float]:
    """Host µs to issue a step with a sample's hooks less without (the median of interleaved pairs' differences),
    per group of rows; a sample's figure is the mean over the groups (each sampled once a cycle) with, on CUDA, one in ACT_EVERY
    of a group's samples reading the allocator.  Amortized: that over the mean gap, and over a RUN_STEPS-step run
    with its dense samples."""
    from phase_timer.measures import modules
    from phase_timer.timing.clock import make_clock

    model, opt, idx, device = setup(args)
    clock = make_clock(device)
    measure = modules.make([model], True, clock, warmup_steps=0, owner="benchmark")
    assert measure is not None
    groups = len(getattr(measure, "groups", ())) or 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = _now(device)
    for _ in range(3):
        issue(model, opt, idx, device)
    reps = -(-max(args.reps, groups) // groups) * groups  # whole cycles
    gc_ns = _gc_clock()
    gc_plain = gc_sampled = 0
    plain: list[int] = []
    by: dict[tuple[int, bool], list[int]] = {}
    own, marks, reads, nodes, calls = [], [], [], [], []
    for i in range(reps):
        sync()  # HOST-DEVICE SYNC: the benchmark's, between timed steps, so that each issues onto an idle queue
        g0 = gc_ns[0]
        t0 = now()
        issue(model, opt, idx, device)
        plain.append(now() - t0)
        gc_plain += gc_ns[0] - g0
        base = plain[-1]
        sync()
        own0 = measure.own_ns
        g0 = gc_ns[0]
        t0 = now()
        measure.begin(i + 1, i)
        sample = measure.sample
        issue(model, opt, idx, device)
        measure.close(True)
        dt = now() - t0
        gc_sampled += gc_ns[0] - g0
        sync()
        n_marks, n_reads = len(sample.marks), getattr(sample, "reads", 0)
        measure.window({})  # read the marks (done after the sync): the resolution's host time is the sample's too
        by.setdefault((getattr(sample, "part", 0), sample.read is not None), []).append(dt - base)  # a pair's
        own.append(measure.own_ns - own0)
        marks.append(n_marks)
        reads.append(n_reads)
        nodes.append(sample.nodes)
        calls.append(len(sample.forward))
    act = getattr(modules, "ACT_EVERY", 4)
    parts = []
    for part in range(groups):
        bare, read = by.get((part, False)), by.get((part, True))
        cost = [statistics.median(v) / 1e3 for v in (bare, read) if v]
        # one in ACT_EVERY of a group's samples reads (CUDA); on the CPU none does
        parts.append(cost[0] if len(cost) == 1 else (cost[0] * (act - 1) + cost[1]) / act)
    extra_us = statistics.mean(parts)
    dense = max(modules.DENSE, groups - 1)  # the device clock's schedule (the host clock's has no dense samples)
    run_samples = samples_in(RUN_STEPS, dense)
    out = {"plain_step_us": statistics.median(plain) / 1e3, "sampled_extra_us": extra_us,
           "amortized_us_per_step": extra_us * run_samples / RUN_STEPS, "amortized_long_us": extra_us / modules.GAP_MEAN,
           "run_steps": float(RUN_STEPS), "run_samples": float(run_samples), "groups": float(groups),
           "gap_mean": float(modules.GAP_MEAN), "own_us": statistics.mean(own) / 1e3,
           "marks": statistics.mean(marks), "reads": statistics.mean(reads), "node_hooks": statistics.mean(nodes),
           "rows": float(len(measure.tree.entries)), "hooked_modules": float(len(measure.tree.targets)),
           "samples_read": float(measure.samples),
           # the garbage collector's time inside the timed steps, a step's mean (µs): plain, and with a sample
           "gc_plain_us": gc_plain / reps / 1e3, "gc_sampled_us": gc_sampled / reps / 1e3}
    _gc_clock(stop=gc_ns)
    for part, v in enumerate(parts):
        out[f"extra_us_group{part}"] = v
    if device.type != "cuda":  # a GPU host pays each mark's record and (CUDA) the reads the CPU does not
        # CUDA reads the allocator at each end of a module call on one in ACT_EVERY of a group's samples
        gpu = extra_us + out["marks"] * GPU_MARK_US + statistics.mean(calls) * 2 / act * GPU_READ_US
        out["gpu_estimate_extra_us"] = gpu
        out["gpu_estimate_us_per_step"] = gpu * run_samples / RUN_STEPS
    return out


def breakdown(args: argparse.Namespace, reps: int = 40) -> dict[str, float]:
    """Where a sample's extra host time goes: each part of a step (begin, forward, backward, optimizer, close, the
    window's read) with a sample's hooks less without, medians over interleaved pairs, the mean over the groups."""
    from phase_timer.measures import modules
    from phase_timer.timing.clock import make_clock

    model, opt, idx, device = setup(args)
    measure = modules.make([model], True, make_clock(device), warmup_steps=0, owner="benchmark")
    assert measure is not None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = _now(device)
    names = ("begin", "forward", "backward", "optimizer", "close", "read")

    def step(i: int | None) -> tuple[int, list[int]]:
        sync()
        t = [now()]
        part = 0
        if i is not None:
            measure.begin(i + 1, i)
            part = getattr(measure.sample, "part", 0)
        t.append(now())
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(idx)
        t.append(now())
        loss.backward()
        t.append(now())
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(now())
        if i is not None:
            measure.close(True)
        t.append(now())
        sync()
        t0 = now()
        if i is not None:
            measure.window({})
        t.append(t[-1] + now() - t0)
        return part, [b - a for a, b in zip(t, t[1:])]

    for i in range(3):
        step(None)
    plain: list[list[int]] = []
    sampled: dict[int, list[list[int]]] = {}
    for i in range(reps):
        plain.append(step(None)[1])
        part, times = step(i)
        sampled.setdefault(part, []).append(times)
    out = {}
    for j, name in enumerate(names):
        base = statistics.median(p[j] for p in plain)
        out[name] = statistics.mean(statistics.median(s[j] for s in v) - base for v in sampled.values()) / 1e3
    out["total"] = sum(out[n] for n in names)
    return out


def run_period(args: argparse.Namespace, on: bool) -> float:
    import phase_timer

    model, opt, idx, device = setup(args)
    data = [idx] * args.steps
    with phase_timer.attach(model, opt, data, summary=False, modules=on, warmup_steps=10, window=50,
                            log_dir=args.log_dir) as timer:
        for batch in timer.loader:
            issue(model, opt, batch, device)
    return timer.totals.phases["period"].mean


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--log-dir", default="/tmp/phase-timer-modules-cost")
    p.add_argument("--out")
    p.add_argument("--cost-only", action="store_true", help="the sampled step's cost and breakdown, no period runs")
    args = p.parse_args()
    from benchmarks.provenance import code_line

    lines = [code_line(), f"model: {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, "
                          f"vocab {args.vocab}, {'cpu' if args.cpu else torch.cuda.get_device_name()}"]
    cost = sampled_step_cost(args)
    lines.append("sampled step: " + ", ".join(f"{k} {v:.1f}" for k, v in cost.items()))
    lines.append("breakdown (extra host us a sample, the mean over the groups): " +
                 ", ".join(f"{k} {v:.1f}" for k, v in breakdown(args).items()))
    if args.cost_only:
        print_and_save("\n".join(lines), args.out)
        return
    periods: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for on in (False, True):
            periods[on].append(run_period(args, on))
    off, on = statistics.median(periods[False]), statistics.median(periods[True])
    lines.append(f"period ms (median of 3 runs): modules=False {off:.3f}, modules=True {on:.3f} "
                 f"({100 * (on - off) / off:+.2f}%); runs: off {periods[False]}, on {periods[True]}")
    print_and_save("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
