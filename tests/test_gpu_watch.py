"""``phase-timer run`` and ``phase-timer watch`` on CUDA: an unmodified Lightning script on one GPU, timed by
``run`` (the script holds no phase-timer), read back by ``watch --once`` and from the live file.  With ``OUT`` set
(the device's output folder) the frame is kept there as an SVG image (``watch_gpu.svg``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("rich")

from phase_timer.outputs.live import LIVE_NAME  # noqa: E402
from phase_timer.outputs.run_summary import FILE_NAME  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=400)


def test_run_times_an_unmodified_script_on_cuda_and_watch_reads_it(tmp_path):
    script = REPO / "tests" / "run_scripts" / "lightning_train.py"
    run = _run("-m", "phase_timer.cli", "run", "--warmup-steps", "2", "--window", "10", "--",
               sys.executable, str(script), str(tmp_path), "--gpu", "--steps", "80")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "script: done" in run.stdout
    run_dir = tmp_path / "lightning_logs" / "version_0"
    summary = json.loads((run_dir / FILE_NAME).read_text())
    assert summary["phases"]["forward"]["clock"] == "cuda"  # the GPU's own clock, not the host's
    assert summary["steps"]["timed"] == 80 - 2
    live = json.loads((run_dir / LIVE_NAME).read_text())
    assert live["status"] == "ended" and live["clock"] == "cuda"
    assert live["verdict"]["kind"] == summary["diagnosis"]["kind"]
    out = os.environ.get("OUT")
    svg = Path(out, "watch_gpu.svg") if out else tmp_path / "watch_gpu.svg"
    watch = _run("-m", "phase_timer.cli", "watch", str(run_dir), "--svg", str(svg))
    assert watch.returncode == 0, watch.stderr
    for phase in ("forward", "backward", "optimizer", "step", "period"):
        assert f"\n{phase} " in watch.stdout, watch.stdout
    assert f"verdict: {summary['diagnosis']['kind']} " in watch.stdout
    assert svg.read_text().lstrip().startswith("<svg")  # the README's picture of a GPU run, kept under OUT


def test_run_times_a_hand_written_loop_on_cuda(tmp_path):
    script = REPO / "tests" / "run_scripts" / "loop_train.py"
    run = _run("-m", "phase_timer.cli", "run", "--warmup-steps", "2", "--log-dir", str(tmp_path / "run"), "--",
               sys.executable, str(script), "--cuda", "--steps", "40")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "timed the hand-written loop from its third step (Net with AdamW)" in run.stderr
    summary = json.loads((tmp_path / "run" / "version_0" / FILE_NAME).read_text())
    assert summary["phases"]["forward"]["clock"] == "cuda" and summary["steps"]["timed"] == 40 - 2 - 2
