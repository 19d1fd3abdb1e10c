"""Phase boundaries against the GPU's own timeline: marker kernels, read from the profiler, on the same steps.

    PYTHONPATH=. python benchmarks/truth.py [--runs plain-lm,plain-conv,lightning-lm,lightning-lm-busy,lightning-conv,hf-gpt2]
                                           [--steps 60] [--out FILE]

The loop (or the LightningModule's hooks) puts a marker at every boundary a user
means -- the batch handed over, the model called, ``backward()`` called and
returned, the optimizer step done, the next batch asked for -- and phase-timer's
per-step values for the same steps are read back from its TensorBoard file.  Two
truths (``--truth``):

* ``profiler`` (default): each marker is a one-element kernel inside a
  ``record_function`` range naming the boundary and the step; ``torch.profiler``
  records a window of steps, each marker's kernel is found through its launch's
  correlation id, and a phase is the difference of two markers' end times on the
  GPU timeline.
* ``events``: no profiler; each marker is a timing event recorded on the current
  stream, and a phase is the elapsed time between two markers' events.  CUPTI
  tracing slows the run and moves event timestamps against kernel timestamps at
  the end of a large backward (docs/benchmarks.md); this truth has neither effect.

No synchronization anywhere in the measured steps: host-bound effects (the GPU
waiting for launches, for the host between steps) stay in, as in a user's run.  In
a host-bound loop the GPU's timestamps follow the host, so a marker and the hook
that phase-timer marks at differ by the host time between them.

Models: a decoder-only transformer LM (32k vocabulary, bf16 autocast, cross-entropy
in fp32, fused AdamW) and a small conv net (fp16 autocast + GradScaler, SGD with
momentum, host-bound).  ``lightning-lm-busy`` lists a callback that spends ~23 ms on
the host in ``on_train_batch_end`` *before* PhaseTimer (issue 17): its time must be
between steps, not in ``optimizer``.  ``hf-gpt2``: the 🤗 door, a ``transformers.Trainer`` on a GPT-2-small-sized
model from a config (bf16), markers at the Trainer's own boundaries (issue 26).

Criterion (issue 19): each phase's median over the steps of phase-timer minus truth
within max(0.1 ms, 2% of the truth's median).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn

# Appended, not prepended: PYTHONPATH chooses which phase_timer is measured (an older release too).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import phase_timer  # noqa: E402
from benchmarks.models import Cycle, Tokens  # noqa: E402

#: phase -> (marker where it begins, marker where it ends)
PHASES = {
    "h2d": ("h2d", "forward"),
    "forward": ("forward", "backward"),
    "backward": ("backward", "optimizer"),
    "optimizer": ("optimizer", "end"),
    "between_steps": ("end", "fetch"),
    "step": ("h2d", "end"),
}
CHECKED = ("forward", "backward", "optimizer")
#: The 🤗 door: accelerate's loader copies the batch inside its fetch, so a step begins with forward.
HF_PHASES = {p: v for p, v in PHASES.items() if p != "h2d"} | {"step": ("forward", "end")}


class Markers:
    """``mark(name, step)`` at a boundary: a marker the truth is read from.

    Under the profiler (``kernels=True``): a one-element kernel in a host range named
    after the boundary and the step.  Without it: a timing event recorded on the
    current stream, taken from a pool made up front so that a marker costs the host
    as little as it can (in a host-bound loop the GPU's timestamps follow the host).
    """

    def __init__(self, device: torch.device, steps: int, kernels: bool, phases: dict[str, tuple[str, str]] = PHASES) -> None:
        self.kernels = kernels
        self.phases = phases
        self.tiny = torch.zeros(1, device=device)
        names = {n for pair in phases.values() for n in pair}
        self.pool = {(s, n): torch.cuda.Event(enable_timing=True) for s in range(steps + 2) for n in names} if not kernels else {}
        self.events: dict[int, dict[str, torch.cuda.Event]] = defaultdict(dict)

    def __call__(self, name: str, step: int) -> None:
        if not self.kernels:
            event = self.pool[step, name]
            event.record()
            self.events[step][name] = event
            return
        from torch.profiler import record_function

        with record_function(f"ptmark|{name}|{step}"):
            self.tiny.add_(1.0)

    def events_per_step(self) -> dict[int, dict[str, float]]:
        """Per step and phase, ms between the markers' events (all done: called after a synchronize)."""
        return {
            s: {p: ev[a].elapsed_time(ev[b]) for p, (a, b) in self.phases.items() if a in ev and b in ev}
            for s, ev in self.events.items()
        }


def marker_ends(trace: str) -> dict[int, dict[str, float]]:
    """{step: {marker: end of its kernel on the GPU timeline, us}} from a Chrome trace of torch.profiler."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ptmark|")]
    launches: dict[Any, list[tuple[float, int]]] = defaultdict(list)  # per host thread: (time, correlation)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e["name"] and "correlation" in e.get("args", {}):
            launches[e["tid"]].append((e["ts"], e["args"]["correlation"]))
    for v in launches.values():
        v.sort()
    kernel_end = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in events if e.get("cat") == "kernel" and "correlation" in e.get("args", {})}
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for r in ranges:
        mine = launches[r["tid"]]
        i = bisect.bisect_left(mine, (r["ts"], -1))
        if i < len(mine) and mine[i][0] <= r["ts"] + r["dur"] and mine[i][1] in kernel_end:
            _, name, step = r["name"].split("|")
            out[int(step)][name] = kernel_end[mine[i][1]]
    return out


def device_busy(prof: Any) -> float:
    """The share of the profiled span in which the device ran anything (kernels, copies, sets): the ground
    truth of GPU- against host-bound.  The span is the first device activity's start to the last one's end;
    CUPTI's tracing adds host time to every launch, so a host-bound loop reads a little less busy under it."""
    spans = sorted((e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA and e.end_ns() > e.start_ns())
    if not spans:
        return 0.0
    busy, (start, end) = 0, spans[0]
    first = start
    for a, b in spans[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    return busy / (end - first)


def truth_per_step(ends: dict[int, dict[str, float]], phases: dict[str, tuple[str, str]] = PHASES) -> dict[int, dict[str, float]]:
    out = {}
    for step, m in ends.items():
        out[step] = {p: (m[b] - m[a]) / 1e3 for p, (a, b) in phases.items() if a in m and b in m}
    return out


def timer_per_step(log_dir: str, offset: int = 0) -> dict[int, dict[str, float]]:
    """phase-timer's per-step values, read back with tensorboard's own reader (logged at step + ``offset``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        if tag.startswith("phase_time_step/"):
            phase = tag.split("/")[1].removesuffix("_ms")
            for e in acc.Scalars(tag):
                out[e.step - offset][phase] = e.value
    return out


def compare(truth: dict[int, dict[str, float]], got: dict[int, dict[str, float]], steps: range,
            phases: dict[str, tuple[str, str]] = PHASES) -> dict[str, dict[str, float]]:
    """Per phase, over the steps both have: medians of truth and phase-timer, and of their difference."""
    rows = {}
    for phase in phases:
        pairs = [(truth[s][phase], got[s][phase]) for s in steps if s in truth and s in got and phase in truth[s] and phase in got[s]]
        if not pairs:
            continue
        t = statistics.median(a for a, _ in pairs)
        diffs = [b - a for a, b in pairs]
        d = statistics.median(diffs)
        rows[phase] = {
            "steps": len(pairs), "truth_ms": t, "phase_timer_ms": statistics.median(b for _, b in pairs), "diff_ms": d,
            "max_abs_diff_ms": max(abs(x) for x in diffs), "ok": abs(d) <= max(0.1, 0.02 * t),
        }
    return rows


# -- models ------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """A decoder-only transformer: the loss is a cross-entropy over a 32k vocabulary, in fp32."""

    def __init__(self, vocab: int = 32768, d: int = 1024, layers: int = 6, seq: int = 1024) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, d // 64, 4 * d, dropout=0.0, batch_first=True, norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))


class ConvNet(nn.Module):
    """Twelve small conv blocks on 32x32 images, batch 16: hundreds of tiny kernels, host-bound."""

    def __init__(self, blocks: int = 12, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for _ in range(blocks):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            c = width
        self.net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float(), targets)


def make(kind: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], torch.dtype]:
    """The model (on the CPU), a few pinned host batches, and the autocast dtype."""
    g = torch.Generator().manual_seed(0)
    pin = (lambda t: t.pin_memory()) if torch.cuda.is_available() else (lambda t: t)
    if kind == "lm":
        seq, batch = 1024, 8
        model = TinyLM(seq=seq)
        data = [(pin(torch.randint(0, model.vocab, (batch, seq), generator=g)),
                 pin(torch.randint(0, model.vocab, (batch, seq), generator=g))) for _ in range(4)]
        return model, data, torch.bfloat16
    model = ConvNet()
    data = [(pin(torch.randn(16, 3, 32, 32, generator=g)), pin(torch.randint(0, 10, (16,), generator=g))) for _ in range(4)]
    return model, data, torch.float16


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "lm":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available())
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


class _NoProfiler:
    """Stands in for the profiler when the truth is the markers' own events (``--truth events``)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


PROFILE = True  # False: no profiler; the truth is the timing events recorded at the markers


def _profile() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if PROFILE else _NoProfiler()


# -- the plain door ------------------------------------------------------------------------------
def plain(kind: str, steps: int = 60, window: tuple[int, int] = (30, 50)) -> dict[str, Any]:
    """A hand-written loop with markers at its boundaries, attached; the profiler on ``window`` steps."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, data, dtype = make(kind)
    model = model.to(dev)
    opt = _optimizer(model, kind)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    mark = Markers(dev, steps, kernels=PROFILE)
    log_dir = tempfile.mkdtemp()
    timer = phase_timer.attach(model, opt, Cycle(data, steps), log_dir=log_dir, per_step=True, warmup_steps=5, summary=False,
                               scaler=scaler)
    prof = _profile()
    for i, (x, y) in enumerate(timer.loader):
        if i == window[0]:
            torch.cuda.synchronize()  # benchmark boundary, before the measured steps
            prof.__enter__()
        # Each marker sits right at the boundary a user means: the batch in hand, the
        # model called, backward() called and returned, the step done, the next batch asked for.
        mark("h2d", i)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=dtype):
            mark("forward", i)
            logits = model(x)
        loss = model.loss(logits, y)
        scaled = scaler.scale(loss) if scaler is not None else loss
        mark("backward", i)
        scaled.backward()
        mark("optimizer", i)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        mark("end", i)
        opt.zero_grad(set_to_none=True)
        mark("fetch", i)
        if i == window[1]:
            torch.cuda.synchronize()  # benchmark boundary, after the measured steps
            prof.__exit__(None, None, None)
    timer.close()
    assert timer.log_dir is not None
    return _result(prof, timer.log_dir, window, mark)


def _result(prof: Any, log_dir: str, window: tuple[int, int], mark: Markers, offset: int = 0) -> dict[str, Any]:
    torch.cuda.synchronize()  # benchmark end: the markers' events are done
    if isinstance(prof, _NoProfiler):
        truth = mark.events_per_step()
    else:
        trace = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(trace)
        truth = truth_per_step(marker_ends(trace), mark.phases)
    # The first and last profiled steps hold the benchmark's synchronizations: left out.
    return compare(truth, timer_per_step(log_dir, offset), range(window[0] + 1, window[1]), mark.phases)


# -- the Lightning door ------------------------------------------------------------------------------
def lightning(kind: str, steps: int = 60, window: tuple[int, int] = (30, 50), busy_ms: float = 0.0) -> dict[str, Any]:
    """A LightningModule whose own hooks launch the markers; PhaseTimer after a busy callback if ``busy_ms``."""
    import lightning.pytorch as pl

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, data, dtype = make(kind)
    mark = Markers(dev, steps, kernels=PROFILE)
    prof = _profile()

    class Marked(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.i = 0

        def _step_index(self) -> int:
            return self.trainer.fit_loop.epoch_loop._batches_that_stepped  # the step PhaseTimer logs at

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            if self.trainer.training:
                self.i = self._step_index()
                if self.i == window[0]:
                    torch.cuda.synchronize()  # benchmark boundary, before the measured steps
                    prof.__enter__()
                mark("h2d", self.i)
            return batch

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            if self.trainer.training:
                mark("forward", self.i)
            return batch

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.model.loss(self.model(x), y)

        def on_before_backward(self, loss: torch.Tensor) -> None:
            mark("backward", self.i)

        def on_after_backward(self) -> None:
            mark("optimizer", self.i)

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            super().optimizer_step(*args, **kwargs)
            mark("end", self.i)

        def on_train_batch_end(self, *args: Any) -> None:  # after every callback's
            mark("fetch", self.i)
            if self.i == window[1]:
                torch.cuda.synchronize()  # benchmark boundary, after the measured steps
                prof.__exit__(None, None, None)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.model, kind)

    class Busy(pl.Callback):
        """Checkpointing, image logging, a profiler: host work at every batch's end."""

        def on_train_batch_end(self, *args: Any) -> None:
            time.sleep(busy_ms / 1e3)

    log_dir = tempfile.mkdtemp()
    timer = phase_timer.PhaseTimer(per_step=True, warmup_steps=5, summary=False, log_dir=log_dir)
    callbacks = [Busy(), timer] if busy_ms else [timer]
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, max_steps=steps, logger=False, callbacks=callbacks,
        precision="bf16-mixed" if dtype == torch.bfloat16 else "16-mixed", enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Marked(), Cycle(data, steps + 1))
    return _result(prof, log_dir, window, mark)


# -- the 🤗 door ---------------------------------------------------------------------------------------
def hf_trainer(steps: int = 60, window: tuple[int, int] = (30, 50)) -> dict[str, Any]:
    """A ``transformers.Trainer`` on a GPT-2-small-sized model from a config (bf16, 8 x 512 tokens): markers
    where the Trainer's loop holds the batches, calls ``accelerator.backward`` and returns from it, returns
    from ``optimizer.step()`` (``on_optimizer_step``), and asks for the next step's batches."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    dev = torch.device("cuda")
    mark = Markers(dev, steps, kernels=PROFILE, phases=HF_PHASES)
    prof = _profile()

    class Marked(Trainer):
        def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
            i = self.state.global_step  # the step these batches are for (the timer's index too)
            if i > 0:
                mark("fetch", i - 1)
            if i == window[1] + 1:
                torch.cuda.synchronize()  # benchmark boundary, after the measured steps
                prof.__exit__(None, None, None)
            out = super().get_batch_samples(*args, **kwargs)
            if i == window[0]:
                torch.cuda.synchronize()  # benchmark boundary, before the measured steps
                prof.__enter__()
            mark("forward", i)  # the step's batches in hand
            return out

    class End(TrainerCallback):
        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            mark("end", state.global_step)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=512))
    log_dir = tempfile.mkdtemp()
    timer = phase_timer.PhaseTimerCallback(per_step=True, warmup_steps=5, summary=False, log_dir=log_dir)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=steps, bf16=True,
                             logging_steps=10, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = Marked(model=model, args=args, train_dataset=Tokens(8 * (steps + 1), 512), callbacks=[End(), timer])
    backward = trainer.accelerator.backward

    def marked_backward(loss: torch.Tensor, **kw: Any) -> None:
        i = trainer.state.global_step
        mark("backward", i)
        backward(loss, **kw)
        mark("optimizer", i)

    trainer.accelerator.backward = marked_backward
    trainer.train()
    assert timer.timer is not None and timer.timer.log_dir is not None
    return _result(prof, timer.timer.log_dir, window, mark, offset=1)  # the Trainer logs step k at k + 1


RUNS = {
    "plain-lm": lambda a: plain("lm", a.steps),
    "plain-conv": lambda a: plain("conv", a.steps),
    "lightning-lm": lambda a: lightning("lm", a.steps),
    "lightning-lm-busy": lambda a: lightning("lm", a.steps, busy_ms=23.0),
    "lightning-conv": lambda a: lightning("conv", a.steps),
    "hf-gpt2": lambda a: hf_trainer(a.steps),
}


def table(name: str, rows: dict[str, dict[str, float]]) -> list[str]:
    lines = []
    for phase, r in rows.items():
        verdict = ("OK" if r["ok"] else "MISS") if phase in CHECKED else ""
        lines.append(
            f"{name:18s} {phase:13s} truth {r['truth_ms']:8.3f}  phase-timer {r['phase_timer_ms']:8.3f}  "
            f"diff {r['diff_ms']:+7.3f} ms (max |diff| {r['max_abs_diff_ms']:.3f}, {r['steps']} steps)  {verdict}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--truth", choices=("profiler", "events"), default="profiler",
                    help="profiler: the markers' kernels on the profiler's timeline; events: the markers' own "
                    "timing events, with no profiler running")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.truth == "profiler"
    names = args.runs.split(",")
    if unknown := set(names) - set(RUNS):
        ap.error(f"--runs: unknown {sorted(unknown)}")
    lines = [f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  phase-timer from "
             f"{os.path.dirname(phase_timer.__file__)}  {time.strftime('%Y-%m-%d')}",
             f"truth: {'marker kernels on the profiler timeline' if PROFILE else 'timing events at the markers, no profiler'}; "
             "median over the measured steps of phase-timer minus truth; OK: within max(0.1 ms, 2%)"]
    for name in names:
        lines += table(name, RUNS[name](args))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
