"""Real 2-process runs on the CPU (gloo): every rank timed, the slow rank named, nothing hangs.

Each run is a separate ``torchrun`` (plain loop) or Lightning-launched job with a
timeout: a hang fails the test instead of stalling the suite.

A rank is slowed by a real sleep (the other rank's wait for it is real too).  What a
sleep guarantees is checked (the sleeping rank's phase holds at least the sleep); where
the other rank's wait went is checked against that rank's other phases in the same
window, never against a constant: a loaded runner stretches every phase.  Where a verdict
must name the slow rank, its sleep also plants hours on its host clock (``--planted-hours``):
a loaded runner's slow loader could otherwise outweigh a 30 ms lead.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from helpers import hours, read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "dist_scripts")
TIMEOUT_S = 240


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("PL_DISABLE_FORK", None)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, proc.stdout[-3000:]
    return proc, results[-1]


def torchrun(*args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return _run([*cmd, os.path.join(SCRIPTS, "plain_ddp.py"), *args])


def lightning(*args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    return _run([sys.executable, os.path.join(SCRIPTS, "lightning_ddp.py"), *args])


def values(scalars: dict, tag: str) -> list[float]:
    assert tag in scalars, sorted(t for t in scalars if "ranks" in t)
    return [v for _, v in scalars[tag]]


def below(scalars: dict, low: str, high: str) -> None:
    """In every window, ``low`` (a phase/stat across ranks) is less than ``high`` (two measurements of one run)."""
    a, b = values(scalars, f"phase_time_ranks/{low}"), values(scalars, f"phase_time_ranks/{high}")
    assert len(a) == len(b) and all(x < y for x, y in zip(a, b)), (low, a, high, b)


def test_plain_torchrun_names_the_slow_rank_and_backward_holds_the_all_reduce(tmp_path: pytest.TempPathFactory) -> None:
    # Rank 1 sleeps 30 ms in every forward (and plants 30 hours); 23 steps in windows of 5 end mid-window.
    proc, result = torchrun("--log-dir", str(tmp_path), "--slow-forward", "0.03", "--planted-hours", "--steps", "23",
                            "--window", "5")
    assert os.listdir(tmp_path) == ["version_0"], "only rank zero writes"
    s = read_scalars(result["log_dir"])
    # every window across ranks, the last (partial) one included
    assert [step for step, _ in s["phase_time_ranks/forward_ms/slowest_rank"]] == [4, 9, 14, 19, 22]
    assert values(s, "phase_timer/ranks_reporting") == [2.0] * 5
    assert values(s, "phase_time_ranks/forward_ms/slowest_rank") == [1.0] * 5
    assert [hours(v) for v in values(s, "phase_time_ranks/forward_ms/max")] == [30] * 5  # rank 1's, its planted hours
    assert [hours(v) for v in values(s, "phase_time_ranks/forward_ms/min")] == [0] * 5  # rank 0's: none
    # Rank 0 waits for rank 1 in DDP's all-reduce: its backward holds the wait (the
    # end of backward comes after DDP's own end-of-backward callback), its forward does not.
    assert values(s, "phase_time_ranks/backward_ms/slowest_rank") == [0.0] * 5
    below(s, "forward_ms/min", "backward_ms/max")  # rank 0's forward, rank 0's backward
    for stat in ("min", "median", "max"):
        assert f"phase_time_ranks/step_ms/{stat}" in s
    # the end-of-run table, per rank
    summary = result["summary"]
    assert "phase-timer (rank 0): 21 steps timed" in summary
    assert "per rank (2 of 2)" in summary
    table = summary.split("per rank")[1].splitlines()
    head = table[2].split()
    slowest = next(line for line in table if line.startswith("slowest")).split()
    assert slowest[head.index("forward")] == "1" and slowest[head.index("backward")] == "0"
    assert proc.stdout.count("per rank (2 of 2)") == 2  # printed once (rank 0), plus its RESULT copy
    # The verdict names the slow rank, its phase, and the others' wait in backward
    with open(os.path.join(result["log_dir"], "phase_timer_summary.json")) as f:
        data = json.load(f)
    d = data["diagnosis"]
    assert d["kind"] == "RANK_STRAGGLER", d
    assert (d["evidence"]["rank"], d["evidence"]["phase"]) == (1, "forward")
    assert d["evidence"]["windows"] == d["evidence"]["of_windows"] == 5
    # the margin over the other rank (with two, the median of both would be half-way): the whole gap, each window
    gaps = [hi - lo for hi, lo in zip(values(s, "phase_time_ranks/forward_ms/max"),
                                             values(s, "phase_time_ranks/forward_ms/min"))]
    assert d["evidence"]["margin_ms"] == pytest.approx(statistics.fmean(gaps), rel=1e-3)
    assert d["evidence"]["others_backward_wait_ms"] > 0  # rank 0's backward is the longer: its wait
    assert data["ranks"]["reported"] == [0, 1] and data["environment"]["world_size"] == 2
    assert "verdict: RANK_STRAGGLER" in summary
    # The job's throughput: each rank's batches (16 samples) over its own period, summed over the ranks
    per_rank = data["ranks"]["per_rank"]
    expected = sum(16 / (per_rank[r]["mean_ms"]["period"] / 1e3) for r in ("0", "1"))
    assert data["throughput"]["job"]["samples_per_s"] == pytest.approx(expected, rel=1e-6)
    assert "the job (every rank)" in summary
    assert values(s, "throughput/job_samples_per_s")


def test_plain_accumulation_with_no_sync_counts_optimizer_steps(tmp_path: pytest.TempPathFactory) -> None:
    # Two micro-batches per step, the first under no_sync; rank 1's loader is slow.
    _, result = torchrun(
        "--log-dir", str(tmp_path), "--accumulate", "2", "--slow-data", "0.004", "--batch", "4", "--steps", "17", "--window", "5"
    )
    s = read_scalars(result["log_dir"])
    assert sum(values(s, "phase_timer/window_steps")) == 15  # 17 optimizer steps, 2 warm-up
    assert values(s, "phase_time_ranks/data_wait_ms/slowest_rank") == [1.0] * 4
    assert min(values(s, "phase_time_ranks/data_wait_ms/max")) >= 2 * 4 * 4.0  # 2 micro-batches x 4 items x 4 ms
    assert "phase_time_ranks/idle_ms/max" in s  # the gap between micro-batches
    assert values(s, "phase_timer/ranks_reporting") == [2.0] * 4


def test_ranks_that_run_different_numbers_of_steps_finish_without_hanging(tmp_path: pytest.TempPathFactory) -> None:
    # No DDP: rank 0 runs 7 more steps than rank 1.  Rank 1's final report says it is
    # done, so rank 0 neither waits for it nor warns (a wait for it ends only at the
    # 60 s timeout, with "no final report within 60 s").
    proc, result = torchrun(
        "--log-dir", str(tmp_path), "--no-ddp", "--steps", "20", "--extra-steps", "7", "--window", "5", "--rank-timeout", "60"
    )
    assert "exchange between ranks stopped" not in proc.stderr and "no final report" not in proc.stderr
    assert result["steps"] == 27
    s = read_scalars(result["log_dir"])
    assert s["phase_time/step_ms/mean"][-1][0] == 26  # rank 0's own last window is written
    reporting = dict(s["phase_timer/ranks_reporting"])
    assert reporting[4] == 2.0 and reporting[19] == 2.0  # while both ran
    assert reporting[26] == 1.0  # rank 0 alone at the end
    assert "per rank (2 of 2)" in result["summary"]


def test_a_rank_that_ran_more_steps_is_waited_for_within_the_timeout(tmp_path: pytest.TempPathFactory) -> None:
    # Rank 1 runs 7 more steps: rank 0, done first, reads on past its own exchanges
    # until rank 1's final report is in, and writes rank 1's last window alone.
    proc, result = torchrun(
        "--log-dir", str(tmp_path), "--no-ddp", "--steps", "20", "--extra-steps", "7", "--extra-rank", "1",
        "--window", "5", "--rank-timeout", "60",
    )
    assert "had not finished" not in proc.stderr and "no final report" not in proc.stderr
    s = read_scalars(result["log_dir"])
    reporting = dict(s["phase_timer/ranks_reporting"])
    assert reporting[19] == 2.0 and reporting[26] == 1.0  # rank 1's last (partial) window
    assert dict(s["phase_time_ranks/step_ms/slowest_rank"])[26] == 1.0


def test_a_rank_still_running_at_the_timeout_is_reported_missing(tmp_path: pytest.TempPathFactory) -> None:
    # Rank 1 is slow (0.2 s a step) and runs 7 more steps: it is still running when
    # rank 0's 2 s wait ends, so rank 0 says its last windows are missing, and ends.
    proc, _ = torchrun(
        "--log-dir", str(tmp_path), "--no-ddp", "--steps", "20", "--extra-steps", "7", "--extra-rank", "1",
        "--slow-forward", "0.2", "--window", "5", "--rank-timeout", "2",
    )
    assert "rank(s) [1] sent no final report within 2 s" in proc.stderr
    assert "rank(s) [1] had not finished when rank 0 did" in proc.stderr


def _fails(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The job fails, and ends: a hang is the subprocess's timeout (TimeoutExpired fails the test)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "planted failure on rank 1" in proc.stderr + proc.stdout
    return proc


def test_an_exception_on_one_rank_ends_the_job_instead_of_hanging(tmp_path: pytest.TempPathFactory) -> None:
    # Rank 1 raises mid-run while rank 0 waits in DDP's all-reduce: rank 1 must not
    # leave a last report behind that keeps its process (and the job) alive.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _fails([*cmd, os.path.join(SCRIPTS, "plain_ddp.py"), "--log-dir", str(tmp_path), "--fail-at", "7"])


def test_an_exception_on_one_lightning_rank_ends_the_job(tmp_path: pytest.TempPathFactory) -> None:
    script = os.path.join(SCRIPTS, "lightning_ddp.py")
    _fails([sys.executable, script, "--root", str(tmp_path), "--strategy", "ddp", "--fail-at", "7"])


def test_lightning_ddp_names_the_rank_with_slow_data(tmp_path: pytest.TempPathFactory) -> None:
    proc, result = lightning("--root", str(tmp_path), "--strategy", "ddp", "--slow-data", "0.004", "--steps", "13")
    assert result["steps"] == 13
    s = read_scalars(result["log_dir"])
    assert values(s, "phase_time_ranks/data_wait_ms/slowest_rank") == [1.0] * 3
    assert min(values(s, "phase_time_ranks/data_wait_ms/max")) >= 4 * 4.0  # rank 1's, with its sleeps
    # rank 0 waits for it in the all-reduce, and not in its own data loading
    assert values(s, "phase_time_ranks/backward_ms/slowest_rank") == [0.0] * 3
    below(s, "data_wait_ms/min", "backward_ms/max")  # rank 0's data_wait, rank 0's backward
    # ... and that wait is backward's exposed communication: DDPStrategy's module split (phase_timer/comm)
    assert values(s, "phase_time_ranks/backward.comm_wait_ms/slowest_rank") == [0.0] * 3
    assert min(values(s, "phase_time_ranks/backward.comm_wait_ms/max")) >= 0.5 * 4 * 4.0
    assert "phase_time_ranks/sync_wait_ms/max" in s  # Lightning's per-batch broadcast, timed apart
    assert "per rank (2 of 2)" in result["summary"]
    assert proc.stdout.count("phase-timer (rank 0)") == 2  # the table once, plus its RESULT copy


def test_lightning_ddp_spawn_with_accumulation(tmp_path: pytest.TempPathFactory) -> None:
    _, result = lightning(
        "--root", str(tmp_path), "--strategy", "ddp_spawn", "--accumulate", "2", "--slow-forward", "0.02", "--steps", "12"
    )
    assert result["runs"] == ["version_0"]
    s = read_scalars(result["log_dir"])
    assert sum(values(s, "phase_timer/window_steps")) == 10  # 12 optimizer steps, 2 warm-up
    assert values(s, "phase_time_ranks/forward_ms/slowest_rank") == [1.0] * 3
    # Between micro-batches (no all-reduce under no_sync) rank 0 waits for rank 1 in
    # Lightning's per-batch broadcast: sync_wait, not data_wait.
    assert values(s, "phase_time_ranks/sync_wait_ms/slowest_rank") == [0.0] * 3
    below(s, "data_wait_ms/max", "sync_wait_ms/max")  # rank 0's sync_wait holds more than either rank's data_wait
    assert min(values(s, "phase_time_ranks/forward_ms/max")) >= 2 * 20.0  # two micro-batches a step
    assert values(s, "phase_timer/ranks_reporting") == [2.0] * 3


def test_hf_trainer_under_torchrun_times_every_rank_and_names_the_slow_one(tmp_path: pytest.TempPathFactory) -> None:
    """The 🤗 door: a Trainer under torchrun (DDP through accelerate, gloo); rank 1 sleeps 30 ms (and plants 30
    hours) in every training forward.  Every rank is timed, rank zero alone writes, and the verdict names rank 1's forward."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(SCRIPTS, "hf_ddp.py"), "--out", str(tmp_path), "--slow-forward", "0.03", "--planted-hours"]
    proc, result = _run(cmd)
    assert result["world_size"] == 2 and result["distributed"] == "distributed"
    assert result["steps"] == [21, 21]  # 23 steps, 2 warm-up, on each rank
    s = read_scalars(result["log_dir"])
    assert values(s, "phase_timer/ranks_reporting") == [2.0] * 5
    assert values(s, "phase_time_ranks/forward_ms/slowest_rank") == [1.0] * 5
    assert [hours(v) for v in values(s, "phase_time_ranks/forward_ms/max")] == [30] * 5  # rank 1's planted hours
    with open(result["summary_path"]) as f:
        data = json.load(f)
    d = data["diagnosis"]
    assert d["kind"] == "RANK_STRAGGLER" and (d["evidence"]["rank"], d["evidence"]["phase"]) == (1, "forward"), d
    assert data["door"] == "transformers" and data["ranks"]["reported"] == [0, 1]
    assert proc.stdout.count("per rank (2 of 2)") == 1  # the table, on rank zero only
    assert not [p for p in os.listdir(tmp_path) if p.startswith("phase-timer-logs") and p != "phase-timer-logs"]


def test_a_rank_holding_more_memory_is_named_through_the_rank_exchange(tmp_path: pytest.TempPathFactory) -> None:
    """Memory across ranks (issue 27): each rank's peak travels with its windows; rank 1 holds 2 GB more
    (a fake allocator on each rank: memory is read on CUDA only)."""
    _, result = torchrun("--log-dir", str(tmp_path), "--steps", "12", "--window", "5", "--fake-memory-extra", "2048")
    s = read_scalars(result["log_dir"])
    assert values(s, "phase_memory_ranks/peak_allocated_mb/largest_rank") == [1.0] * 3
    assert values(s, "phase_memory_ranks/peak_allocated_mb/max")[-1] == pytest.approx(3048)
    with open(os.path.join(result["log_dir"], "phase_timer_summary.json")) as f:
        data = json.load(f)
    peaks = {r: v["peak_allocated_mb"] for r, v in data["memory"]["ranks"].items()}
    assert peaks == {"0": pytest.approx(1000), "1": pytest.approx(3048)}
    found = {d["kind"]: d for d in [data["diagnosis"], *data["diagnosis"]["secondary"]]}
    assert found["MEMORY_RANK_IMBALANCE"]["evidence"]["rank"] == 1


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_which_module_names_the_module_where_the_slow_rank_loses_its_time(tmp_path: pytest.TempPathFactory,
                                                                          wrap: str) -> None:
    """Rank 1 sleeps 30 ms (and plants 30 hours) in its ``pause`` module's forward; with ``modules=True`` every rank
    samples the same steps and reports its rows to rank zero, whose table and summary name ``pause`` as where rank 1
    loses its forward's time, against rank 0's own reading of the same module: under DDP and under FSDP2."""
    proc, result = torchrun("--log-dir", str(tmp_path), "--slow-forward", "0.03", "--planted-hours", "--steps", "23",
                            "--window", "5", "--modules", *(["--fsdp2"] if wrap == "fsdp2" else []))
    import jsonschema

    from phase_timer.outputs.run_summary import schema

    with open(os.path.join(result["log_dir"], "phase_timer_summary.json")) as f:
        data = json.load(f)
    jsonschema.validate(data, schema())
    block = data["modules"]["ranks"]
    assert sorted(block["per_rank"]) == ["0", "1"]
    assert (hours(block["per_rank"]["0"]["pause"]["forward_ms"]), hours(block["per_rank"]["1"]["pause"]["forward_ms"])) \
        == (0, 30)
    (slow,) = block["slow"]  # forward's alone: rank 0's longer backward (its wait for rank 1) is in no module
    assert (slow["rank"], slow["phase"], slow["module"]) == (1, "forward", "pause"), slow
    assert hours(slow["module_gap_ms"]) == 30
    assert slow["module_others_ms"] == block["per_rank"]["0"]["pause"]["forward_ms"]
    line = next(l for l in result["summary"].splitlines() if l.startswith("modules ("))
    assert "every rank: rank 1's forward" in line and "of it in pause" in line, line
    print(line)
    # rank 1's own rows stay its own: rank zero's table rows are rank 0's
    assert data["modules"]["rows"]["pause"]["forward_ms"] == block["per_rank"]["0"]["pause"]["forward_ms"]
