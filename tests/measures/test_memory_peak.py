"""The peak's phase on recorded sequences (issue 39): a steady loop's jitter, a later spike, a user's reset.

A memory step reads the allocator's counters at each boundary it passes; the steps between are not
read.  :class:`Recorded` replays such a run into a :class:`~phase_timer.measures.memory.MemoryTracker` with a
:class:`tests.fakes.FakeAllocator` whose numbers each test plants: the reads a memory step makes, in
the order the boundaries make them, and the allocations of the steps nobody reads.  Each test here
fails on the rule before issue 39 (the phase of the last rise seen, "between samples" for any rise
no read pair holds), which gave a steady 1 GiB backward temporary away to a rise of a few KB.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.measures import memory as memory_mod
from phase_timer.measures.memory import BETWEEN_SAMPLES, MemoryTracker, peak_tolerance
from phase_timer.outputs.table import format_memory
from tests.fakes import FakeAllocator

WEIGHTS, BATCH, ACT, GRADS, STATE = 900.0, 10.0, 184.0, 50.0, 200.0  # MB
TEMP = 1024.0  # a 1 GiB temporary made and freed inside backward, every step
KB = 1 / 1024


class Recorded:
    """A training loop's allocations, read at the boundaries of its memory steps only (``reads``: the steps read)."""

    def __init__(self, reads: set[int]) -> None:
        self.fake = FakeAllocator()
        self.fake.alloc(WEIGHTS)
        self.tracker = MemoryTracker(self.fake.read)
        self.reads = reads

    def step(self, k: int, *, backward_temp: float = TEMP, optimizer_temp: float = 0.0, jitter: float = 0.0) -> None:
        """Step ``k``: batch, activations kept by forward, a temporary in backward (``jitter`` MB larger on a step
        not read: allocation order varies), gradients, the optimizer's state at the first step and its temporary."""
        fake, t, read = self.fake, self.tracker, k in self.reads
        extra = 0.0 if read else jitter
        if read:
            t.begin(k + 1, k, "h2d")
        fake.alloc(BATCH)
        t.read("forward") if read else None
        fake.alloc(ACT)
        t.read("backward") if read else None
        fake.alloc(backward_temp + extra), fake.free(backward_temp + extra)
        fake.alloc(GRADS) if k == 0 else None  # .grad is made once and kept
        fake.free(ACT)
        t.read("optimizer") if read else None
        fake.alloc(STATE) if k == 0 else None
        fake.alloc(optimizer_temp + extra), fake.free(optimizer_temp + extra)
        t.read("between_steps") if read else None
        t.end_step() if read else None
        fake.free(BATCH)

    def end(self, step: int) -> dict:
        self.tracker.mark("after the last step", step + 1, step)  # the run's end reads the counters once
        return self.tracker.as_dict()


# Dense at first, then far apart: as the schedule reads a long run (memory.DENSE, then MEDIUM_GAP and SPARSE_GAP).
READS = set(range(8)) | set(range(8, 300, 50))
# The backward temporary's peak from step 1 on (the optimizer's state made at step 0 is held from then).
BACKWARD_PEAK = WEIGHTS + GRADS + STATE + BATCH + ACT + TEMP


def test_a_steady_loops_jitter_of_a_few_kb_between_samples_leaves_the_peak_in_backward():
    run = Recorded(READS)
    for k in range(300):
        run.step(k, jitter=4 * KB * (k % 5))  # 0-16 KB more on the steps not read: the peak counter inches up
    mem = run.end(299)
    assert mem["peak_allocated_mb"] == pytest.approx(BACKWARD_PEAK + 16 * KB)  # the counter's own, to the byte
    assert mem["peak_phase"] == "backward" and mem["peak_step"] == 1  # the first step with the optimizer's state
    # each phase's highest where the counter rose in it: backward's peak; forward's and h2d's at step 0
    assert mem["phase_peaks_mb"] == {"backward": pytest.approx(BACKWARD_PEAK),
                                     "forward": pytest.approx(WEIGHTS + BATCH + ACT),
                                     "h2d": pytest.approx(WEIGHTS + BATCH)}
    assert list(mem["phase_peaks_mb"]) == ["backward", "forward", "h2d"]  # highest first


def test_a_real_spike_in_a_later_phase_takes_the_peak_and_keeps_it_against_jitter():
    run = Recorded(READS)
    spike = 158  # a memory step (8 + 50k): from here on the optimizer makes a temporary larger than backward's
    assert spike in READS
    for k in range(300):
        run.step(k, optimizer_temp=TEMP + 300.0 if k >= spike else 0.0, jitter=4 * KB * (k % 5))
    mem = run.end(299)
    opt_peak = WEIGHTS + GRADS + STATE + BATCH + TEMP + 300.0
    assert opt_peak - BACKWARD_PEAK > peak_tolerance(int(opt_peak * (1 << 20))) / (1 << 20)  # beyond the tolerance
    assert mem["peak_phase"] == "optimizer" and mem["peak_step"] == spike
    assert mem["phase_peaks_mb"]["optimizer"] == pytest.approx(opt_peak)
    assert mem["phase_peaks_mb"]["backward"] == pytest.approx(BACKWARD_PEAK)


def test_a_spike_between_samples_beyond_the_tolerance_is_between_samples():
    run = Recorded(READS)
    for k in range(300):
        run.step(k, backward_temp=TEMP + (100.0 if k == 120 else 0.0))  # once, on a step not read
    mem = run.end(299)
    assert 120 not in READS
    assert mem["peak_phase"] == BETWEEN_SAMPLES and mem["peak_step"] == 158  # the first read after it saw it
    assert mem["peak_allocated_mb"] == pytest.approx(BACKWARD_PEAK + 100.0)
    assert mem["phase_peaks_mb"]["backward"] == pytest.approx(BACKWARD_PEAK)  # what the reads saw it reach


def test_after_a_users_reset_a_phase_that_comes_back_near_the_peak_is_named():
    """The backward temporary begins on a step not read ("between samples"); the user resets the peak after every
    step (their own logging), so the memory steps after it see the counter rise in backward to that peak again."""
    run = Recorded(READS)
    first = 30  # not read: the first rise to the peak is between samples
    assert first not in READS
    for k in range(300):
        run.step(k, backward_temp=TEMP if k >= first else 0.0)
        if k >= first:
            run.fake.reset_peak()  # torch.cuda.reset_peak_memory_stats()
    mem = run.end(299)
    assert mem["peak_phase"] == "backward" and mem["peak_step"] == 58  # the first memory step after the reset
    assert mem["peak_allocated_mb"] == pytest.approx(BACKWARD_PEAK)  # the highest read: never lowered by a reset
    assert mem["phase_peaks_mb"]["backward"] == pytest.approx(BACKWARD_PEAK)


def test_after_a_reset_a_rise_below_the_peak_takes_nothing():
    run = Recorded(READS)
    for k in range(300):
        run.step(k, backward_temp=TEMP if k == 3 else 0.0)  # the peak: step 3's backward, read
        run.fake.reset_peak()
    mem = run.end(299)
    assert mem["peak_phase"] == "backward" and mem["peak_step"] == 3
    assert mem["peak_allocated_mb"] == pytest.approx(BACKWARD_PEAK)
    # later memory steps saw the counter rise again, to well below the peak: each phase's highest is kept
    assert mem["phase_peaks_mb"]["forward"] == pytest.approx(WEIGHTS + GRADS + STATE + BATCH + ACT)


def test_the_tolerance_is_one_percent_at_least_16_mb_at_most_a_tenth():
    mb = 1 << 20
    assert peak_tolerance(80_000 * mb) == 800 * mb
    assert peak_tolerance(1000 * mb) == 16 * mb
    assert peak_tolerance(50 * mb) == 5 * mb


def test_the_table_says_each_phases_highest_and_which_is_the_peak():
    run = Recorded(READS)
    for k in range(300):
        run.step(k, jitter=4 * KB * (k % 5))
    text = format_memory(run.end(299))
    assert "the highest each phase reached (where the peak counter rose in it): backward 2.31 GiB (the peak), " \
           "forward 1.07 GiB, h2d 910 MiB" in text
    assert "peak allocated 2.31 GiB in backward (step 1)" in text


# -- through a door, the fake allocator planted where phase-timer reads the real one ------------------
class SpikyBackward(nn.Module):
    """A model whose backward makes a TEMP temporary every step, a few KB larger on the steps phase-timer does not
    read (it counts the fake allocator's reads): the issue's Lightning demo, as seen by the allocator's counters."""

    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fake, self.net, self.calls = fake, nn.Linear(4, 1), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake, reads, k = self.fake, self.fake.reads, self.calls
        self.calls += 1
        fake.alloc(ACT)
        out = self.net(x)

        def backward(grad: torch.Tensor) -> None:
            jitter = 0.0 if fake.reads > reads else 4 * KB * (k % 5)  # a memory step has read since forward began
            fake.alloc(TEMP + jitter), fake.free(TEMP + jitter)
            fake.free(ACT)

        out.register_hook(backward)
        return out


@pytest.fixture
def fake(monkeypatch) -> FakeAllocator:
    """The allocator every timer made in the test reads (also on the host clock, where memory is otherwise absent)."""
    alloc = FakeAllocator()
    alloc.alloc(WEIGHTS)
    monkeypatch.setattr(memory_mod, "reader_for", lambda clock: (alloc.read, alloc.info))
    return alloc


def test_plain_door_names_backward_for_a_steady_backward_temporary(fake, tmp_path):
    model = SpikyBackward(fake)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(300)]
    with phase_timer.attach(model, opt, data, log_dir=str(tmp_path), warmup_steps=2) as timer:
        for x, y in timer.loader:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    mem = json.load(open(timer.summary_path))["memory"]
    assert mem["peak_phase"] == "backward" and mem["peak_step"] == 0
    assert mem["peak_allocated_mb"] > WEIGHTS + ACT + TEMP  # the jitter of a step not read is in the counter
    assert mem["phase_peaks_mb"]["backward"] == pytest.approx(WEIGHTS + ACT + TEMP)
    assert "backward 2.06 GiB (the peak)" in timer.last_summary


def test_lightning_door_names_backward_for_a_steady_backward_temporary(fake, tmp_path):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = SpikyBackward(fake)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader([(torch.randn(4), torch.randn(1)) for _ in range(200 * 4)], batch_size=4)
    timer = phase_timer.PhaseTimer(warmup_steps=2, log_dir=str(tmp_path))
    trainer = pl.Trainer(max_steps=200, callbacks=[timer], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), data)
    mem = json.load(open(timer.summary_path))["memory"]
    assert mem["peak_phase"] == "backward" and mem["peak_step"] == 0
    assert mem["peak_allocated_mb"] > WEIGHTS + ACT + TEMP
    assert mem["phase_peaks_mb"]["backward"] == pytest.approx(WEIGHTS + ACT + TEMP)
