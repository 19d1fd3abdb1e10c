"""phase-timer's own files where the run's logger writes: a local folder, or an fsspec URL (issue 48)."""

from __future__ import annotations

import json
import os

import pytest

from phase_timer import files
def test_a_local_file_is_written_whole_and_readable_as_the_umask_says(tmp_path) -> None:
    path = files.write(tmp_path / "a" / "b.json", b"{}")
    assert open(path, "rb").read() == b"{}" and os.listdir(tmp_path / "a") == ["b.json"]  # no temporary left
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


def test_a_url_is_written_through_fsspec(monkeypatch, tmp_path) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    path = files.write(files.join("memory://phase-timer-test/run/", "x.json"), b"[1]")
    assert path == "memory://phase-timer-test/run/x.json"
    assert fsspec.filesystem("memory").cat("/phase-timer-test/run/x.json") == b"[1]"
    assert os.listdir(tmp_path) == []  # no local folder named "memory:"


def test_a_lightning_logger_on_a_url_gets_the_summary_and_the_trace(monkeypatch, tmp_path) -> None:
    """Lightning's CSVLogger on ``memory://`` (its own tests' remote filesystem): the summary file and the trace
    reach the logger's directory, nothing lands in a local folder named after the URL."""
    fsspec = pytest.importorskip("fsspec")
    pl = pytest.importorskip("lightning.pytorch")
    from phase_timer import PhaseTimer
    from tests.helpers import loader, module_class, trainer

    monkeypatch.chdir(tmp_path)
    timer = PhaseTimer(warmup_steps=2, trace_steps=(3, 6))
    t = trainer("lightning.pytorch", str(tmp_path / "root"), [timer], max_steps=25,
                logger=pl.loggers.CSVLogger("memory://pt-remote", name="run"))
    t.fit(module_class("lightning.pytorch")(), loader())
    fs = fsspec.filesystem("memory")
    run_dir = t.logger.log_dir.removeprefix("memory://")
    doc = json.loads(fs.cat(f"{run_dir}/phase_timer_summary.json"))
    assert doc["steps"]["timed"] == 23
    trace = json.loads(fs.cat(f"{run_dir}/phase_trace.json"))
    assert any(e.get("cat") == "phase" for e in trace["traceEvents"])
    assert not any(name.startswith("memory") for name in os.listdir(tmp_path))
    assert timer.summary_path == f"memory://{run_dir}/phase_timer_summary.json"
