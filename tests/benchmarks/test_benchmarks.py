"""The benchmark scripts run end to end (a CPU smoke run: their figures mean nothing here).

The overhead scripts check themselves as they run: the resolved runs assert that
the timer timed exactly the steps of its own blocks (so switching variants between
blocks works), and their in-situ host-time runs that every step past the warm-up
was timed.
"""

from __future__ import annotations

import re

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, tmp_path: Path, *args: str) -> str:
    out = tmp_path / "out.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args, "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out.read_text()


@pytest.mark.timeout(300)
def test_lightning_launch_bound(tmp_path):
    text = run_benchmark("lightning_launch_bound.py", tmp_path, "--rounds", "2", "--block", "10",
                         "--warmup-rounds", "1", "--inside-steps", "60")
    for row in ("none", "empty Callback", "PhaseTimer (default)", "python burn"):
        assert f"\n{row}" in text
    for hook in ("batch_to_device wrapper", "on_before_backward", "on_after_backward", "on_train_batch_end",
                 "fetch hook _on_before_fetch", "step end (optimizer post-hook)"):
        assert hook in text


@pytest.mark.timeout(300)
def test_plain_launch_bound(tmp_path):
    text = run_benchmark("launch_bound.py", tmp_path, "--rounds", "2", "--block", "5", "--variants", "attach",
                         "--inside-steps", "60")
    assert "attach (phase-timer default)" in text and "host time inside the plain door's hook bodies" in text
    for body in ("_fetch", "_on_batch", "_on_forward", "_backward_began", "_backward_ended", "_on_optimizer_end"):
        assert body in text


@pytest.mark.timeout(300)
def test_in_situ_primitives(tmp_path):
    text = run_benchmark("in_situ_primitives.py", tmp_path, "--steps", "50")
    for call in ("mark", "done (record 2 steps back)", "spans (6 marks)", "release (6 marks)"):
        assert f"\n{call} " in text
    assert "the engine's driver calls per step" in text


@pytest.mark.timeout(300)
def test_host_cost_on_the_host_clock(tmp_path):
    text = run_benchmark("host_cost.py", tmp_path, "--host-clock", "--steps", "300")
    assert "core step on the host clock" in text
    for sink in ("none", "event file (default)"):
        assert f"\n{sink} " in text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", [False, True], ids=["all-ranks", "a-leader-killed"])
def test_rank_exchange_at_four_ranks(tmp_path, kill):
    # Four real processes over a real TCPStore, in a tree of fan-in 2 (ranks 1 and 3 lead a group of two,
    # rank 0 the root): every window written with every rank (or, with rank 1, a leader, killed mid-run,
    # with the other three: its group read on by rank 0, and rank 1 named gone); the script exits non-zero
    # when a check fails.  Then 256 simulated ranks in one process (a tree 8 levels deep).  The figures up
    # to 16k ranks are in docs/benchmarks.md.
    args = ["--ranks", "4", "--windows", "20", "--fan-in", "2", "--scale", "256", "--scale-windows", "3",
            "--store", "hash", "--old-rev", ""] + (["--kill"] if kill else [])
    text = run_benchmark("rank_exchange.py", tmp_path, *args)
    assert text.startswith("phase_timer tree ")
    assert f"windows 20/20 with {3 if kill else 4} ranks: yes" in text and "slowest named: rank 3" in text
    assert ("killed rank 1: gone=[1]" in text) == kill
    assert "   256 ranks: rank 0 per window new" in text and "slowest and median right: yes" in text


#: What the old design's files (``rank_exchange.OLD_REV``: ``metrics.py``, ``ranks.py``, ``diagnosis.py``) import from
#: the rest of the package at module level, by the module names they had then (``git show 5b5f317:phase_timer/...``).
OLD_DESIGN_IMPORTS = {"memory": ("BEFORE", "BEFORE_NOTE"), "stats": ("WINDOW_STATS", "RunTotals"), "cpu_use": ("CpuUse",),
                      "input_advice": ("Run", "advise"), "syncs": ("SyncCensus", "SyncSite")}


def test_the_old_designs_imports_resolve_to_todays_modules():
    # The tests run rank_exchange.py without its old design (--old-rev ""); the default run loads it beside
    # today's, its imports resolved through _OLD_NAMES: a name moved out of its module breaks that run only.
    import importlib

    from benchmarks.rank_exchange import _OLD_NAMES

    for old, names in OLD_DESIGN_IMPORTS.items():
        today = importlib.import_module(f"phase_timer.{_OLD_NAMES[old]}")
        assert [n for n in names if not hasattr(today, n)] == [], (old, _OLD_NAMES[old])


@pytest.mark.timeout(300)
def test_quickstart_advice(tmp_path):
    text = run_benchmark("quickstart_advice.py", tmp_path, "--pairs", "1", "--steps", "40", "--variants", "shipped,batched")
    assert text.startswith("phase_timer tree ")
    for variant in ("shipped", "batched"):
        assert f"round 1 {variant}" in text and f"\n{variant}" in text and "period p50 by round" in text


@pytest.mark.timeout(300)
def test_input_advice(tmp_path):
    text = run_benchmark("input_advice.py", tmp_path, "--pairs", "1", "--cases", "cheap")
    # what the benchmark prints, whatever this machine's load makes of the verdict and the periods (its figures are
    # a quiet machine's: results/input_advice_cpu.txt)
    assert text.startswith("phase_timer tree ") and re.search(r"^cheap: [A-Z_]+", text, re.M) and "medians" in text


def test_the_code_line_names_the_tree_git_names(tmp_path):
    """The tree hash of phase_timer/ as a GPU results file records it is git's own (a clean copy of HEAD's
    files gives HEAD:phase_timer), and an edit changes it."""
    import subprocess

    from benchmarks.provenance import ROOT, code_line, tree_hash

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "HEAD:phase_timer").strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    archive = subprocess.run(["git", "archive", "HEAD", "phase_timer"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    copy = tmp_path / "phase_timer"
    (copy / "__pycache__").mkdir(exist_ok=True)  # what git ignores does not count
    (copy / "__pycache__" / "x.pyc").write_bytes(b"0")
    (copy / "_native.cpython-311-x86_64-linux-gnu.so").write_bytes(b"0")
    assert tree_hash(str(copy)) == head
    (copy / "phases.py").write_text((copy / "phases.py").read_text() + "\n")
    assert tree_hash(str(copy)) != head
    line = code_line()
    clean = not git("status", "--porcelain", "--", "phase_timer")
    assert line.startswith("phase_timer tree ") and (("= HEAD" in line) if clean else ("dirty" in line))


def test_the_doors_benchmark_reads_the_copies_estimate_off_rank_zero_s_summary(tmp_path):
    import json

    sys.path.insert(0, str(ROOT))
    from benchmarks.comm_doors import copies_estimate, span_of
    from phase_timer.measures.comm.run import less_copies
    from phase_timer.outputs.run_summary import FILE_NAME

    assert copies_estimate(str(tmp_path)) == (None, None)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / FILE_NAME).write_text(json.dumps({"communication": {"copies_ms": 0.812,
                                                                            "copies_waited_ms": 0.7}}))
    assert copies_estimate(str(tmp_path)) == (0.812, 0.7)
    (tmp_path / "run" / FILE_NAME).write_text(json.dumps({"communication": None}))
    assert copies_estimate(str(tmp_path)) == (None, None)
    # span_of undoes run.less_copies wherever the wait is positive, on either side of WAITED_MS
    for span in (0.9, 1.0, 1.061, 1.063, 1.2, 5.0):
        assert span_of(less_copies(span, 0.812, 0.7), 0.812, 0.7) == pytest.approx(span), span
    assert span_of(0.3, 0.812, None) == pytest.approx(1.112) and span_of(0.3, None, None) is None
