"""Every example runs as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_scalars

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(300)
def test_lightning_quickstart(tmp_path):
    out = run_example("lightning_quickstart.py", tmp_path, "--steps", "60")
    assert "phase-timer: 55 steps timed" in out
    scalars = read_scalars(str(tmp_path / "lightning_logs" / "version_0"))
    assert [s for s, _ in scalars["phase_time/forward_ms/mean"]] == [19, 39, 59]


@pytest.mark.timeout(300)
def test_plain_pytorch(tmp_path):
    out = run_example("plain_pytorch.py", tmp_path, "--steps", "60")
    assert "phase-timer: 55 steps timed" in out and "clip" in out
    scalars = read_scalars(str(tmp_path / "phase-timer-logs" / "version_0"))
    assert [s for s, _ in scalars["phase_time/clip_ms/mean"]] == [19, 39, 59]
