"""Every file a run writes takes the umask's mode, as ``open()`` gives: the summary too, so that another user
or a CI step that can read the event files can ``report`` and ``compare`` the run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.cli import main


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_summary_trace_event_and_figure_files_take_the_umask(umask, mode, tmp_path, capsys):
    old = os.umask(umask)
    try:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with phase_timer.attach(model, opt, None, log_dir=str(tmp_path / "run"), warmup_steps=1, window=2,
                                trace_steps=(2, 4)) as timer:
            for _ in range(6):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        run = Path(timer.summary_path).parent
        assert main(["report", "--png", str(tmp_path / "report.png"), str(run)]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    written = {p.name: _mode(p) for p in run.iterdir() if p.is_file()}
    assert "phase_timer_summary.json" in written and "phase_trace.json" in written
    assert any(name.startswith("events.out.tfevents.") for name in written), written
    assert written == dict.fromkeys(written, mode)
    assert _mode(tmp_path / "report.png") == mode
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]  # the temporary file was renamed
