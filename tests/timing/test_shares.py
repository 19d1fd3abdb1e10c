"""The share column on a real plain loop: a custom phase inside the step is the step's, one between steps is not.

Each run below puts a custom phase in one place (inside the step, between steps, open across the step's end)
and reads the shares back from every place they are written: the printed table, the run's totals, its
summary file, ``phase-timer report`` (text, JSON from each source) and the data the ``--png`` bar is drawn
from.  The step's shares must add up to 100% everywhere, and the footnote must name what each share is of.
Both engines (C and Python) run each loop.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phase_timer
from phase_timer.cli import main
from phase_timer.timing.engine import Steps
from phase_timer.phases import share_base
from phase_timer.cli.report_plot import share_bars
from phase_timer.cli.report_runs import load_runs

STEPS = 24
NAP_S = 0.001  # a custom phase's own time: material beside a tiny model's step, whatever the machine


def _train(kind: str, log_dir: Path) -> phase_timer.LoopTimer:
    """A plain loop with gradient accumulation (so ``idle`` is there) and one custom phase, placed by ``kind``."""
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(2 * STEPS * 8, 8), torch.randn(2 * STEPS * 8, 1)), batch_size=8)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, opt, loader, log_dir=str(log_dir), window=4, warmup_steps=2,
                            per_step=True) as timer:
        for i, (x, y) in enumerate(timer.loader):
            nn.functional.mse_loss(model(x), y).backward()
            if i % 2 == 0:  # the first micro-batch of two: no step
                continue
            if kind == "clip":  # the README's own: inside the step
                with timer.phase("clip"):
                    time.sleep(NAP_S)
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            elif kind == "ema":  # after optimizer.step(): between steps
                opt.step()
                with timer.phase("ema"), torch.no_grad():
                    time.sleep(NAP_S)
            else:  # "across": open across the step's end, so part inside the step and part after it
                with timer.phase("stepping"):
                    time.sleep(NAP_S)
                    opt.step()
                    time.sleep(NAP_S)
            opt.zero_grad()
    return timer


#: Per run: the phases that are the step's (their shares of `step` add up to 100%), and the rest, of `period`.
OF_STEP = {
    "clip": ["h2d", "forward", "backward", "optimizer", "idle", "clip"],
    "ema": ["h2d", "forward", "backward", "optimizer", "idle"],
    "across": ["h2d", "forward", "backward", "optimizer", "idle", "stepping"],
}
OF_PERIOD = {
    "clip": ["data_wait", "between_steps"],
    "ema": ["data_wait", "between_steps", "between_steps.ema"],
    "across": ["data_wait", "between_steps", "between_steps.stepping"],
}
KINDS = list(OF_STEP)
ENGINES = ["C", "Python"] if Steps is not None else ["Python"]


@pytest.fixture(scope="module", params=[(k, e) for e in ENGINES for k in KINDS], ids=lambda p: f"{p[0]}-{p[1]}")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    kind, engine = request.param
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PHASE_TIMER_NATIVE", "1" if engine == "C" else "0")
        timer = _train(kind, tmp_path_factory.mktemp(f"{kind}-{engine}"))
    assert timer.totals is not None and timer.totals.steps == STEPS - 2
    return {"kind": kind, "timer": timer, "dir": Path(timer.summary_path).parent}


def _table(text: str) -> tuple[dict[str, float | None], str]:
    """The printed table's share per phase (None: blank) and its footnote."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    shares = {}
    for line in lines[rules[1] + 1 : rules[2]]:
        cells = line.split()
        shares[cells[0]] = float(cells[-1].rstrip("%")) if cells[-1].endswith("%") else None
    note = next(line for line in lines if line.startswith("share: "))
    return shares, note


def _step_sum(shares: dict[str, float | None], of_step: list[str]) -> float:
    return sum(shares[p] or 0.0 for p in of_step if p in shares)


def test_the_printed_table_gives_the_step_100_percent_and_says_what_each_share_is_of(run):
    shares, note = _table(run["timer"].last_summary)
    kind = run["kind"]
    # the step's phases together, then the time between steps
    assert [p for p in shares if p not in ("step", "period")] == ["data_wait", *OF_STEP[kind], *OF_PERIOD[kind][1:]]
    assert _step_sum(shares, OF_STEP[kind]) == pytest.approx(100.0, abs=0.2 + 0.05 * len(OF_STEP[kind]))
    assert note.startswith(f"share: {', '.join(OF_STEP[kind])} of `step`; {', '.join(OF_PERIOD[kind])} of `period`")


def test_the_totals_step_phases_add_up_to_the_step(run):
    totals = run["timer"].totals.phases
    of_step = [p for p in totals if share_base(p) == "step"]
    assert sorted(of_step) == sorted(OF_STEP[run["kind"]])
    assert sum(totals[p].total for p in of_step) == pytest.approx(totals["step"].total, rel=1e-9)
    assert sorted(p for p in totals if share_base(p) == "period") == sorted(OF_PERIOD[run["kind"]])


def test_the_summary_file_gives_the_step_100_percent(run):
    phases = json.loads(Path(run["timer"].summary_path).read_text())["phases"]
    of_step = [p for p, row in phases.items() if row["share_of"] == "step"]
    assert of_step == OF_STEP[run["kind"]]
    assert [p for p, row in phases.items() if row["share_of"] == "period"] == OF_PERIOD[run["kind"]]
    assert sum(phases[p]["share"] for p in of_step) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("source", ["summary", "step", "window"])
def test_report_json_and_text_give_the_step_100_percent(run, source, capsys):
    kind = run["kind"]
    assert main(["report", "--json", "--source", source, str(run["dir"])]) == 0
    phases = json.loads(capsys.readouterr().out)["runs"][0]["phases"]
    # window means of phases every step has add up as the steps do
    assert sum(phases[p]["share"] for p in OF_STEP[kind]) == pytest.approx(1.0, abs=1e-6)
    assert main(["report", "--source", source, str(run["dir"])]) == 0
    text = capsys.readouterr().out
    note = next(line for line in text.splitlines() if line.startswith("share: "))
    assert note.startswith(f"share: {', '.join(OF_STEP[kind])} of `step`; {', '.join(OF_PERIOD[kind])} of `period`")
    rows = {c[0]: c[-1] for line in text.splitlines() if (c := line.split()) and c[0] in phases}
    assert sum(float(rows[p].rstrip("%")) for p in OF_STEP[kind]) == pytest.approx(100.0, abs=0.2 + 0.05 * 6)


@pytest.mark.parametrize("source", ["summary", "step", "window"])
def test_the_png_bar_reaches_100_percent(run, source, tmp_path, capsys):
    bars = share_bars(load_runs([str(run["dir"])], source))
    assert list(bars) == OF_STEP[run["kind"]]
    assert math.fsum(widths[0] for widths in bars.values()) == pytest.approx(100.0, abs=1e-4)
    png = tmp_path / "report.png"
    assert main(["report", "--png", str(png), "--source", source, str(run["dir"])]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
