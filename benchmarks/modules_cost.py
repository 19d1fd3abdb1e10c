"""What which-module costs: a sampled step's host time, the amortized cost a step, and a GPU-bound run's overhead.

    PYTHONPATH=. python benchmarks/modules_cost.py [--layers 12] [--width 768] [--seq 1024] [--batch 8]
                                                   [--steps 300] [--reps 30] [--out FILE]
    PYTHONPATH=. python benchmarks/modules_cost.py --cpu --layers 2 --width 64 --seq 32 --batch 2   # a smoke run

A GPT-2-124M-class model (``--layers 12 --width 768``, vocabulary 50,257, tied head; the default tree: 12 blocks
as one row with their ``ln_1``/``attn``/``ln_2``/``mlp``, ``wte``, ``wpe``, ``ln_f``, ``lm_head``), bf16 autocast.

1. **A sampled step's host time**: the host's time to issue one training step (forward, backward, optimizer; no
   wait for the device in it) with the sample's hooks on, less the same without, medians over ``--reps`` pairs;
   the hooks' own registration and removal included (``ModuleTimes.begin``/``close``).  Amortized: that over the
   mean gap between samples (``modules.GAP_MEAN`` steps).
2. **A GPU-bound run's overhead**: ``attach()`` runs of ``--steps`` steps with ``modules=True`` and
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
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(idx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sampled_step_cost(args: argparse.Namespace) -> dict[str, float]:
    """Host µs to issue a step with the sample's hooks, and without (medians over pairs)."""
    from phase_timer.measures import modules
    from phase_timer.timing.clock import make_clock

    model, opt, idx, device = setup(args)
    clock = make_clock(device)
    measure = modules.make([model], True, clock, warmup_steps=0, owner="benchmark")
    assert measure is not None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        issue(model, opt, idx, device)
    plain, sampled = [], []
    for i in range(args.reps):
        sync()  # HOST-DEVICE SYNC: the benchmark's, between timed steps, so that each issues onto an idle queue
        t0 = time.perf_counter_ns()
        issue(model, opt, idx, device)
        plain.append(time.perf_counter_ns() - t0)
        sync()
        t0 = time.perf_counter_ns()
        measure.begin(i + 1, i)
        issue(model, opt, idx, device)
        measure.close(True)
        sampled.append(time.perf_counter_ns() - t0)
        sync()
        measure.window({})  # read the marks (done after the sync): the resolution's host time is the sample's too
    extra_us = (statistics.median(sampled) - statistics.median(plain)) / 1e3
    return {"plain_step_us": statistics.median(plain) / 1e3, "sampled_step_us": statistics.median(sampled) / 1e3,
            "sampled_extra_us": extra_us, "amortized_us_per_step": extra_us / modules.GAP_MEAN,
            "rows": float(len(measure.tree.entries)), "hooked_modules": float(len(measure.tree.targets)),
            "samples_read": float(measure.samples)}


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
    args = p.parse_args()
    from benchmarks.provenance import code_line

    lines = [code_line(), f"model: {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, "
                          f"vocab {args.vocab}, {'cpu' if args.cpu else torch.cuda.get_device_name()}"]
    cost = sampled_step_cost(args)
    lines.append("sampled step: " + ", ".join(f"{k} {v:.1f}" for k, v in cost.items()))
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
