"""Exposed communication on one CUDA device (issue 38): DDP (NCCL, world size 1) against the profiler's timeline.

The runs are ``benchmarks/comm_truth.py``'s (its docstring says how the truth is read): the "collective" is a
comm hook's spin kernel of known length on a side stream; the truth is the profiler's union-of-intervals rule.
Each test prints its figures (``COMM`` lines); the benchmark's table is ``benchmarks/results/comm_truth_h100.txt``.
The real NCCL collectives across two GPUs, and FSDP2's all-gathers, are ``test_gpu_distributed.py``'s.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPIN_MS = 4.0


@pytest.fixture(scope="module")
def case():
    import torch.distributed as dist

    from benchmarks.comm_truth import cycles_per_ms, run

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}  # put back: later tests launch jobs
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    cpm = cycles_per_ms()
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = run(name, 15, SPIN_MS, cpm, 4096, 8, 8192)
            print("COMM", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in done[name].items()})
        return done[name]

    yield get
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_a_collective_left_after_backward_is_the_wait_within_0_1_ms_of_the_profiler(case):
    r = case("late_view")  # no copy into .grad: the span is the wait alone
    assert r["spin"] > 0.5  # the planted collective ran, and was long
    assert r["copy_ms"] is None and r["truth"] == pytest.approx(r["stream"], abs=0.01)  # no copies: one truth
    assert r["wait"] == pytest.approx(r["truth"], abs=0.1)


def test_the_same_collective_hidden_behind_backward_is_no_wait(case):
    r = case("early_view")
    assert r["spin"] > 0.5 and r["truth"] < 0.1  # hidden, by the profiler's rule too
    assert r["wait"] < 0.1


def test_ddp_s_copies_into_grad_are_timed_and_taken_off_the_wait(case):
    """gradient_as_bucket_view=False: DDP copies each result into .grad inside its end-of-backward.  The copies
    timed where they run on sampled backwards (each bucket's between two marks) match the profiler's kernels under
    copy_bucket_to_grad (their own time, with a queued launch gap of at most 3 us each and the marks' own), and
    what is left of the span is the compute stream's wait (the union of every other kernel on the timeline, DDP's
    copies included)."""
    for name in ("late", "early", "default"):
        r = case(name)
        assert r["copies"] > 0.05  # DDP copied, by the profiler
        # their own time, a queued launch gap (at most 3 us) each, and each bucket's two marks (8 buckets) on the
        # stream beside them (an H200 reads 0.321 ms for 0.273 ms of copies: 0.5 us over the copies' gaps alone)
        assert r["copies"] <= r["copy_ms"] <= r["copies"] + (16 + 8) * 0.003, name
        assert r["wait"] == pytest.approx(r["stream"], abs=0.1), name


def test_the_copies_estimate_holds_on_a_model_of_200_parameter_tensors(case):
    """Issue 47: with many small parameters DDP launches many small copies, a bucket each here.  Where the device
    is behind the host (a batch the device takes longer over than the host takes to launch it), each bucket's
    copies, between two marks, read their own time and a queued launch gap (at most 3 us) each.  (Where the
    device has caught up with the host, the copies run at the pace of DDP's launches, which the marks hold and the
    estimate does not take: docs/design.md.)"""
    from benchmarks.comm_truth import cycles_per_ms, run

    case("view")  # the process group is up
    # 100 x Linear(256), 200 tensors, a bucket each; 65536 rows: backward's kernels outlast their launches
    r = run("default", 15, SPIN_MS, cycles_per_ms(), 256, 100, 65536)
    print("COMM copies200", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    assert r["copies"] > 0.05
    assert r["copies"] <= r["copy_ms"] <= r["copies"] + 200 * 0.003


def test_the_split_adds_no_sync(case):
    assert case("default")["syncs"] == case("ddp_off")["syncs"]  # DDP's own, counted by the profiler alike


def test_fsdp2_on_one_device_runs_split_and_adds_up(case, tmp_path):
    """World size 1: FSDP2 skips its all-gathers; nothing breaks, and the phases add up.  Its reduce-scatters have
    done by the time the host reaches their waits (one rank: nothing to wait for), and a wait the device has
    passed gets no marks: ``backward.comm_wait`` is there only where a step waited, and then inside backward."""
    import phase_timer
    from phase_timer.phases import share_base, whole_phases
    from torch.distributed.fsdp import fully_shard

    case("view")  # the process group is up
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    data = [torch.randn(256, 1024, device="cuda") for _ in range(12)]
    timer = phase_timer.attach(net, opt, data, log_dir=str(tmp_path), window=4, warmup_steps=2, summary=False)
    for x in timer.loader:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    phases = {p: t.mean for p, t in timer.close().phases.items()}
    print("COMM fsdp2", {p: round(v, 3) for p, v in phases.items()})
    assert phases.get("backward.comm_wait", 0.0) < 0.5 * phases["backward"]
    inside = [p for p in whole_phases(phases) if share_base(p) == "step" and p != "step"]
    assert sum(phases[p] for p in inside) == pytest.approx(phases["step"], rel=1e-6)
