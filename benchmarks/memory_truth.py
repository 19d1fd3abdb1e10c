"""Memory per phase against the allocator's truth, on the 32k-vocabulary LM of ``truth.py``, both doors (CUDA).

The truth is a separate run of the same steps without phase-timer that, at the same boundaries,
waits for the device (``torch.cuda.synchronize()``) and reads ``torch.cuda.memory_allocated()``,
and resets the peak at each boundary, so that each phase's own peak is known.  phase-timer's run
reads neither with a sync nor with a reset.  Cases:

* ``activations``: the LM as ``truth.py`` trains it (bf16 autocast, 8 x 1024 tokens): allocated at
  forward's and backward's begin, and their difference, against the truth's.
* ``forward`` / ``backward`` / ``optimizer``: a 512 MB temporary made and freed inside that phase, every step, on
  the LM in fp32 at 1 x 256 tokens (so that the temporary, not the activations, sets the peak; the
  truth says which phase holds the peak): the phase phase-timer names against the truth's.
* ``leak``: 8 MB kept every step (a tensor appended to a list): MEMORY_CREEP and its rate;
  ``steady``: the same run without it: no creep.
* ``syncs``: the profiler's runtime-API sync calls over steps 0-40 with memory read and without.

Usage: ``python -m benchmarks.memory_truth [--out FILE]`` (writes the table and a JSON of the figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from typing import Any

import torch
from torch import nn

import phase_timer
from benchmarks.models import Cycle
from benchmarks.truth import TinyLM

MB = 1 << 20
TEMP_MB = 512
LEAK_MB = 8
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize")


def build(config: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], torch.dtype | None]:
    """The LM on the device, a few pinned host batches, the autocast dtype (None: fp32)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    seq, batch, dtype = (1024, 8, torch.bfloat16) if config == "lm" else (256, 1, None)
    model = TinyLM(seq=seq).cuda()
    data = [(torch.randint(0, model.vocab, (batch, seq), generator=g).pin_memory(),
             torch.randint(0, model.vocab, (batch, seq), generator=g).pin_memory()) for _ in range(4)]
    return model, data, dtype


class Truth:
    """At each boundary: wait for the device, read allocated, and the peak since the last boundary (then reset it)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.peaks: dict[str, float] = {}  # phase -> the largest peak inside it over the run
        self._phase: str | None = None

    def __call__(self, boundary: str) -> None:
        torch.cuda.synchronize()  # the truth run only: phase-timer's never waits
        if boundary == "forward":
            self.steps.append({})
        peak = torch.cuda.max_memory_allocated() / MB
        if self._phase is not None:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0.0), peak)
        self.steps[-1][boundary] = torch.cuda.memory_allocated() / MB
        torch.cuda.reset_peak_memory_stats()  # the truth run only: phase-timer never resets
        self._phase = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "end": "between_steps"}[boundary]

    def activations(self, first: int = 2) -> float:
        acts = [s["backward"] - s["forward"] for s in self.steps[first:]]
        return sum(acts) / len(acts)

    @property
    def peak_phase(self) -> str:
        return max(self.peaks, key=self.peaks.get)


def _temp(where: str, plant: str | None) -> None:
    if plant == where:
        t = torch.empty(TEMP_MB * MB, dtype=torch.uint8, device="cuda")
        del t  # made and freed inside the phase


def _in_backward(logits: torch.Tensor, plant: str | None) -> None:
    """``backward``: the temporary made and freed inside backward (a hook on the logits' gradient: its first act)."""
    if plant == "backward" and logits.requires_grad:
        logits.register_hook(lambda grad: _temp("backward", plant))


def run_plain(config: str, steps: int, *, timed: bool = True, memory: bool = True, plant: str | None = None,
              leak: bool = False, truth: Truth | None = None, profile: tuple[int, int] | None = None,
              spike_at: int | None = None) -> dict[str, Any]:
    """A hand-written loop, attached (``timed``) or not; the run's memory summary, verdict and peak."""
    base = _clean()
    model, data, dtype = build(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    hook = model.emb.register_forward_hook(lambda *a: _temp("forward", plant))  # inside the model's forward
    note = truth or (lambda boundary: None)
    kept: list[torch.Tensor] = []
    log_dir = tempfile.mkdtemp()
    torch.cuda.reset_peak_memory_stats()  # before the timer exists: the run's own peak, as a user reads it
    timer = phase_timer.attach(model, opt, Cycle(data, steps), log_dir=log_dir, warmup_steps=5, summary=False,
                               memory=memory) if timed else None
    loader = timer.loader if timer is not None else Cycle(data, steps)
    prof = _profiler()
    for i, (x, y) in enumerate(loader):
        if profile is not None and i == profile[0]:
            prof.__enter__()
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        note("forward")
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            logits = model(x)
        _in_backward(logits, plant)
        loss = model.loss(logits, y)
        note("backward")
        loss.backward()
        note("optimizer")
        _temp("optimizer", plant if spike_at is None or i == spike_at else None)
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay: the planted temporary, not them, sets the peak
        note("end")
        if leak:
            kept.append(torch.empty(LEAK_MB * MB, dtype=torch.uint8, device="cuda"))
        if profile is not None and i == profile[1]:
            prof.__exit__(None, None, None)
    if timer is not None:
        timer.close()
    hook.remove()
    out = _result(timer.summary_path if timer is not None else None, base)
    if profile is not None:
        names = [e.name for e in prof.events()]
        out["syncs"] = sum(names.count(n) for n in SYNC_CALLS)
    return out


def run_lightning(config: str, steps: int, *, timed: bool = True, plant: str | None = None, leak: bool = False,
                  truth: Truth | None = None) -> dict[str, Any]:
    """A LightningModule with PhaseTimer (``timed``) or without; the truth read in the module's own hooks."""
    import lightning.pytorch as pl

    base = _clean()
    model, data, dtype = build(config)
    note = truth or (lambda boundary: None)
    kept: list[torch.Tensor] = []

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.hook = model.emb.register_forward_hook(lambda *a: _temp("forward", plant))

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            note("forward")
            return batch

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(x)
            _in_backward(logits, plant)
            return self.model.loss(logits, y)

        def on_before_backward(self, loss: torch.Tensor) -> None:
            note("backward")

        def on_after_backward(self) -> None:
            note("optimizer")

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            _temp("optimizer", plant)

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=False)

        def on_train_batch_end(self, *args: Any) -> None:
            note("end")
            if leak:
                kept.append(torch.empty(LEAK_MB * MB, dtype=torch.uint8, device="cuda"))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)

    log_dir = tempfile.mkdtemp()
    timer = phase_timer.PhaseTimer(warmup_steps=5, summary=False, log_dir=log_dir)
    torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=steps, logger=False,
                         callbacks=[timer] if timed else [], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, precision="bf16-mixed" if dtype is not None else "32-true")
    batches = [data[i % len(data)] for i in range(steps)]  # a map-style dataset of ready batches
    trainer.fit(LM(), torch.utils.data.DataLoader(batches, batch_size=None))
    path = os.path.join(log_dir, "phase_timer_summary.json") if timed else None
    return _result(path, base)


def _profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _clean() -> float:
    """What the earlier runs left is collected; returns allocated MB before this run (its baseline)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / MB


def _result(summary_path: str | None, base: float) -> dict[str, Any]:
    out: dict[str, Any] = {"run_peak_mb": torch.cuda.max_memory_allocated() / MB - base, "baseline_mb": base}
    if summary_path is not None:
        with open(summary_path) as f:
            data = json.load(f)
        out["memory"] = data["memory"]
        d = data["diagnosis"] or {}
        out["findings"] = {f["kind"]: f for f in [d, *d.get("secondary", [])] if f}
    return out


def activations_case(door: str) -> dict[str, float]:
    """phase-timer's allocated at forward's and backward's begin, and activations, against the truth's (MB)."""
    run = run_plain if door == "plain" else run_lightning
    truth = Truth()
    run("lm", 40, timed=False, truth=truth)
    got = run("lm", 40)["memory"]["allocated_mb"]
    t = truth.steps[2:]
    return {"forward_begin": got["forward_begin"]["mean"], "truth_forward_begin": sum(s["forward"] for s in t) / len(t),
            "backward_begin": got["backward_begin"]["mean"], "truth_backward_begin": sum(s["backward"] for s in t) / len(t),
            "activations": got["activations"]["mean"], "truth_activations": truth.activations()}


def peak_case(door: str, plant: str) -> dict[str, Any]:
    run = run_plain if door == "plain" else run_lightning
    truth = Truth()
    run("small", 40, timed=False, plant=plant, truth=truth)
    got = run("small", 40, plant=plant)
    return {"planted": plant, "truth_phase": truth.peak_phase, "phase": got["memory"]["peak_phase"],
            "step": got["memory"]["peak_step"], "peak_mb": got["memory"]["peak_allocated_mb"],
            "truth_peaks_mb": truth.peaks}


def creep_case(door: str, leak: bool, steps: int = 100) -> dict[str, Any]:
    run = run_plain if door == "plain" else run_lightning
    got = run("small", steps + 5, leak=leak)  # 100 timed steps after the 5 of warm-up
    creep = got["findings"].get("MEMORY_CREEP")
    return {"leak_mb_per_step": LEAK_MB if leak else 0, "creep": creep is not None,
            "rate": creep["evidence"]["mb_per_step"] if creep else got["memory"]["creep"]["mb_per_step"],
            "points": got["memory"]["creep"]["points"]}


def peak_unchanged_case() -> dict[str, float]:
    """The user's ``max_memory_allocated()`` over the same steps (above what was allocated before them),
    without the timer, with it, and without it again, after a first run (the process's first steps allocate
    once-only state: cuBLAS's workspace).  A one-off 512 MB spike at step 8 sets the peak early: a reset of
    the peak after it would lower "with"."""
    kw = {"plant": "optimizer", "spike_at": 8}
    run_plain("small", 30, timed=False, **kw)
    return {"without": run_plain("small", 30, timed=False, **kw)["run_peak_mb"],
            "with": run_plain("small", 30, **kw)["run_peak_mb"],
            "without_again": run_plain("small", 30, timed=False, **kw)["run_peak_mb"]}


def syncs_case() -> dict[str, int]:
    """Runtime-API sync calls over steps 0-40 (the dense memory steps among them), memory read or not."""
    return {"memory": run_plain("small", 50, memory=True, profile=(0, 40))["syncs"],
            "no_memory": run_plain("small", 50, memory=False, profile=(0, 40))["syncs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    res: dict[str, Any] = {}
    for door in ("plain", "lightning"):
        res[f"{door}/activations"] = activations_case(door)
        for plant in ("forward", "backward", "optimizer"):
            res[f"{door}/peak_{plant}"] = peak_case(door, plant)
        res[f"{door}/leak"] = creep_case(door, True)
        res[f"{door}/steady"] = creep_case(door, False)
    res["peak_unchanged"] = peak_unchanged_case()
    res["syncs"] = syncs_case()
    for k, v in res.items():
        print(f"{k:28s} {json.dumps(v, default=lambda x: round(x, 3))}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
