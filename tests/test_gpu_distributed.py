"""On 2 CUDA devices (NCCL): every rank timed, the slowed rank named, for DDP and FSDP, both doors.

Run with ``pytest -m gpu``; skipped without 2 GPUs.  The sync-count and overhead
figures come from ``benchmarks/distributed.py``; the sync check is also a test here.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import read_scalars
from tests.distributed.test_distributed import lightning, torchrun, values

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_plain_loop_on_two_gpus_names_the_slow_rank(tmp_path, wrapper: str) -> None:
    extra = ["--fsdp"] if wrapper == "fsdp" else []
    _, result = torchrun("--log-dir", str(tmp_path), "--slow-forward", "0.02", "--width", "1024", "--steps", "33", "--window", "10", *extra)
    s = read_scalars(result["log_dir"])
    assert values(s, "phase_timer/ranks_reporting") == [2.0] * 4
    # on the device clock: rank 1's GPU idles inside forward while its host sleeps ...
    assert values(s, "phase_time_ranks/forward_ms/slowest_rank") == [1.0] * 4
    assert min(values(s, "phase_time_ranks/forward_ms/max")) >= 20.0
    # ... and rank 0's GPU waits for it in the gradient all-reduce / reduce-scatter, inside backward
    assert values(s, "phase_time_ranks/backward_ms/slowest_rank") == [0.0] * 4
    assert min(values(s, "phase_time_ranks/backward_ms/max")) >= 15.0
    assert "per rank (2 of 2)" in result["summary"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lightning_on_two_gpus_names_the_slow_rank(tmp_path, strategy: str) -> None:
    _, result = lightning("--root", str(tmp_path), "--strategy", strategy, "--slow-forward", "0.02", "--width", "1024", "--steps", "23")
    s = read_scalars(result["log_dir"])
    assert values(s, "phase_timer/ranks_reporting") == [2.0] * 5
    assert values(s, "phase_time_ranks/forward_ms/slowest_rank") == [1.0] * 5
    assert min(values(s, "phase_time_ranks/forward_ms/max")) >= 20.0
    assert "per rank (2 of 2)" in result["summary"]


def test_no_sync_added_on_either_rank(tmp_path) -> None:
    # The profiler's runtime-API trace over steady-state steps, both ranks, with and without the timer.
    counts = {}
    for label, extra in (("off", ["--no-timer"]), ("on", [])):
        proc, result = torchrun("--log-dir", str(tmp_path / label), "--steps", "40", "--profile-syncs", "--width", "1024", *extra)
        rank1 = [line for line in proc.stdout.splitlines() if line.startswith("RANK1SYNCS ")]
        assert rank1, proc.stdout[-2000:]
        counts[label] = (result["syncs"], json.loads(rank1[-1][len("RANK1SYNCS "):]))
    assert counts["on"] == counts["off"], counts
