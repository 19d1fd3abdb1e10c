"""``phase-timer report`` on real runs: tables, JSON, figure, errors."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from phase_timer.phases import ordered
from phase_timer.cli import main
from phase_timer.timing.stats import summarize
from tests.helpers import event_files, loader, module_class, read_scalars, trainer

ROOT = Path(__file__).resolve().parents[2]
NS = "lightning.pytorch"
STEPS = 40
WINDOW = 5
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real Lightning runs under one root: window summaries only, and with per-step values."""
    from phase_timer import PhaseTimer

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    root = tmp_path_factory.mktemp("report")
    for per_step in (False, True):
        timer = PhaseTimer(warmup_steps=1, per_step=per_step, summary=False)
        t = trainer(NS, str(root), [timer], max_steps=STEPS, log_every_n_steps=WINDOW)
        t.fit(module_class(NS)(), loader())
        os.unlink(timer.summary_path)  # runs from before the summary file: TensorBoard alone
    return {"root": root, "window": root / "logs" / "version_0", "step": root / "logs" / "version_1"}


def report(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def report_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> dict:
    code, out, err = report(capsys, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def phases_of(scalars: dict, prefix: str) -> list[str]:
    return ordered({t[len(prefix) :].split("/")[0].removesuffix("_ms") for t in scalars if t.startswith(prefix)})


def window_expected(scalars: dict, phase: str) -> dict[str, float]:
    """What the report should say from window summaries, computed here from EventAccumulator's values."""
    vals = {s: [v for _, v in scalars[f"phase_time/{phase}_ms/{s}"]] for s in ("mean", "p50", "p90", "max")}
    return {
        "mean_ms": statistics.fmean(vals["mean"]),
        "p50_ms": statistics.median(vals["p50"]),
        "p90_ms": max(vals["p90"]),
        "max_ms": max(vals["max"]),
    }


def table_rows(out: str) -> dict[str, list[str]]:
    phases = {"data_wait", "h2d", "forward", "backward", "optimizer", "idle", "between_steps", "step", "period"}
    return {cells[0]: cells[1:] for line in out.splitlines() if (cells := line.split()) and cells[0] in phases}


# -- tables ------------------------------------------------------------------------------
def test_table_names_every_phase_with_event_accumulator_numbers(runs, capsys):
    code, out, err = report(capsys, runs["window"])
    assert code == 0, err
    scalars = read_scalars(str(runs["window"]))
    phases = phases_of(scalars, "phase_time/")
    assert phases == ["data_wait", "h2d", "forward", "backward", "optimizer", "between_steps", "step", "period"]
    rows = table_rows(out)
    assert list(rows) == phases  # every phase, in the library's order
    for phase in phases:
        exp = window_expected(scalars, phase)
        assert rows[phase][:4] == [f"{exp[k]:.3f}" for k in ("mean_ms", "p50_ms", "p90_ms", "max_ms")], phase
    assert rows["step"][4] == "100.0%" and len(rows["period"]) == 4  # period: no share
    dw = window_expected(scalars, "data_wait")["mean_ms"] / window_expected(scalars, "period")["mean_ms"]
    assert rows["data_wait"][4] == f"{100 * dw:.1f}%"
    # Columns say what they are.
    assert "mean of" in out and "window means" in out and "median of" in out and "max of" in out
    assert f"run: {runs['window']}" in out and "8 logging windows" in out


def test_table_from_per_step_values_is_exact(runs, capsys):
    code, out, err = report(capsys, runs["step"])
    assert code == 0, err
    scalars = read_scalars(str(runs["step"]))
    rows = table_rows(out)
    for phase in phases_of(scalars, "phase_time_step/"):
        exp = summarize(v for _, v in scalars[f"phase_time_step/{phase}_ms"])
        assert rows[phase][:4] == [f"{exp[s]:.3f}" for s in ("mean", "p50", "p90", "max")], phase
    assert f"{STEPS - 1} steps timed" in out and "exact statistics over per-step values" in out
    assert "window means" not in out


# -- JSON --------------------------------------------------------------------------------
def test_json_schema_and_values_from_windows(runs, capsys):
    doc = report_json(capsys, runs["window"])
    assert list(doc) == ["runs"] and len(doc["runs"]) == 1
    run = doc["runs"][0]
    assert run["run"] == str(runs["window"])
    assert run["source"] == "window" and run["steps"] is None
    assert run["windows"] == STEPS // WINDOW and run["skipped_steps"] == 0
    scalars = read_scalars(str(runs["window"]))
    assert list(run["phases"]) == phases_of(scalars, "phase_time/")
    for phase, stats in run["phases"].items():
        assert set(stats) == {"mean_ms", "p50_ms", "p90_ms", "max_ms", "share"}
        for key, value in window_expected(scalars, phase).items():
            assert stats[key] == pytest.approx(value, rel=1e-12), (phase, key)
    p = run["phases"]
    assert p["step"]["share"] == 1.0 and p["period"]["share"] is None
    assert p["forward"]["share"] == pytest.approx(p["forward"]["mean_ms"] / p["step"]["mean_ms"])
    assert p["data_wait"]["share"] == pytest.approx(p["data_wait"]["mean_ms"] / p["period"]["mean_ms"])
    device = ("h2d", "forward", "backward", "optimizer")
    assert sum(p[d]["share"] for d in device) == pytest.approx(1.0, rel=1e-6)


def test_json_from_per_step_values(runs, capsys):
    run = report_json(capsys, runs["step"])["runs"][0]
    scalars = read_scalars(str(runs["step"]))
    assert run["source"] == "step" and run["steps"] == STEPS - 1  # step 0 was warm-up
    for phase, stats in run["phases"].items():
        values = [v for _, v in scalars[f"phase_time_step/{phase}_ms"]]
        assert len(values) == STEPS - 1
        exp = summarize(values)
        assert [stats[k] for k in ("mean_ms", "p50_ms", "p90_ms", "max_ms")] == pytest.approx(
            [exp[s] for s in ("mean", "p50", "p90", "max")], rel=1e-12
        )
    total = lambda phase: sum(v for _, v in scalars[f"phase_time_step/{phase}_ms"])  # noqa: E731
    assert run["phases"]["backward"]["share"] == pytest.approx(total("backward") / total("step"))
    assert run["phases"]["data_wait"]["share"] == pytest.approx(total("data_wait") / total("period"))


def test_source_can_be_forced(runs, capsys):
    assert report_json(capsys, "--source", "window", runs["step"])["runs"][0]["source"] == "window"
    code, _, err = report(capsys, "--source", "step", runs["window"])
    assert code == 2 and str(runs["window"]) in err and "per_step=True" in err


# -- from the run summary file ---------------------------------------------------------------
@pytest.fixture(scope="module")
def summary_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real Lightning run that keeps its summary file, with per-step values to check it against."""
    from phase_timer import PhaseTimer

    os.environ.setdefault("PL_DISABLE_FORK", "1")
    root = tmp_path_factory.mktemp("report_summary")
    timer = PhaseTimer(warmup_steps=1, per_step=True, summary=False)
    t = trainer(NS, str(root), [timer], max_steps=STEPS, log_every_n_steps=WINDOW)
    t.fit(module_class(NS)(), loader())
    return {"dir": Path(timer.log_dir), "file": Path(timer.summary_path), "diagnosis": timer.diagnosis}


def test_with_a_summary_file_the_report_is_the_runs_own(summary_run, capsys):
    from phase_timer.diagnosis import format_verdict

    code, out, err = report(capsys, summary_run["dir"])
    assert code == 0, err
    assert f"{STEPS - 1} steps timed, 0 skipped (max_pending), 1 warm-up" in out
    assert "the run's own statistics over every timed step" in out
    assert "p99 ms" in out and "window means" not in out
    scalars = read_scalars(str(summary_run["dir"]))
    rows = table_rows(out)
    for phase in phases_of(scalars, "phase_time_step/"):
        exact = sorted(v for _, v in scalars[f"phase_time_step/{phase}_ms"])
        mean, p50, p90, p99, mx = (float(c) for c in rows[phase][:5])
        assert mean == pytest.approx(statistics.fmean(exact), abs=1e-3), phase
        assert mx == pytest.approx(exact[-1], abs=1e-3), phase
        for got, q in ((p50, 50), (p90, 90), (p99, 99)):
            # The run's histogram (1% buckets): within 0.5% of a step's value at that rank (+ the 3 decimals).
            pos = (len(exact) - 1) * q / 100
            lo, hi = exact[int(pos)], exact[min(int(pos) + 1, len(exact) - 1)]
            assert lo * 0.995 - 1e-3 <= got <= hi * 1.005 + 1e-3, (phase, q, got, lo, hi)
    assert "All on the host clock" in out
    assert format_verdict(summary_run["diagnosis"]) in out  # the verdict, as the run printed it
    own = json.loads(summary_run["file"].read_text())["own_cost"]  # 1 step in ~96 is sampled: maybe none here
    assert ("phase-timer's own host time:" in out) == (own is not None)


def test_summary_json_carries_the_verdict_and_the_exact_columns(summary_run, capsys):
    run = report_json(capsys, summary_run["file"])["runs"][0]  # the file itself names the run
    assert run["source"] == "summary" and run["clock"] == "host" and run["steps"] == STEPS - 1
    assert run["diagnosis"] == summary_run["diagnosis"].as_dict()
    assert run["interrupted"] is False and run["steps_in_flight"] is None  # nothing is in flight on the host clock
    assert set(run["phases"]["step"]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "share"}
    data = json.loads(summary_run["file"].read_text())
    assert run["own_cost"] == data["own_cost"]
    for p, stats in run["phases"].items():
        assert stats["mean_ms"] == data["phases"][p]["mean_ms"]


def test_source_summary_on_a_run_without_one_is_an_error(runs, summary_run, capsys):
    assert report_json(capsys, "--source", "step", summary_run["dir"])["runs"][0]["source"] == "step"
    code, _, err = report(capsys, "--source", "summary", runs["window"])
    assert code == 2 and "no phase_timer_summary.json" in err


def test_a_summary_file_alone_is_a_run_with_its_own_windows(summary_run, tmp_path, capsys):
    alone = tmp_path / "ci_artifact"
    alone.mkdir()
    shutil.copy(summary_run["file"], alone / "phase_timer_summary.json")
    png = tmp_path / "alone.png"
    code, out, err = report(capsys, alone, "--png", png)
    assert code == 0, err
    assert "the run's own statistics" in out and png.read_bytes()[:8] == PNG_MAGIC
    doc = report_json(capsys, alone)
    assert doc["runs"][0]["windows"] == len(json.loads(summary_run["file"].read_text())["windows"]["steps"])


def test_an_interrupted_run_says_so_and_a_corrupt_summary_is_an_error(summary_run, tmp_path, capsys):
    data = json.loads(summary_run["file"].read_text())
    data["interrupted"] = True
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "phase_timer_summary.json").write_text(json.dumps(data))
    code, out, _ = report(capsys, cut)
    assert code == 0 and "the run was interrupted" in out
    (cut / "phase_timer_summary.json").write_text('{"schema": "phase-timer/run-')
    code, out, err = report(capsys, cut)
    assert code == 2 and out == "" and "not JSON" in err and len(err.strip().splitlines()) == 1


# -- memory (CUDA runs; planted here, the reader is what is tested) -----------------------------
MEM_STEPS = (1, 2, 3, 4, 5, 6, 7, 8, 15, 25, 35)  # memory steps: dense first, then sparse
BEGIN_MB, FIRST_MB, ACT_MB = 1250.0, 1000.0, 100.0  # the first two steps: before the optimizer's state


def planted_memory(peak_mb: float = 1410.0, *, reserved_mb: float = 2048.0, act_mb: float = ACT_MB) -> dict:
    """A summary file's ``memory`` object (schema version 4) with planted values."""
    stat = lambda v: {"mean": v, "max": v}  # noqa: E731
    return {
        "samples": len(MEM_STEPS), "steady_samples": len(MEM_STEPS) - 2,
        "allocated_mb": {"step_begin": stat(BEGIN_MB), "forward_begin": stat(BEGIN_MB + 10),
                         "backward_begin": stat(BEGIN_MB + 10 + act_mb), "optimizer_begin": stat(BEGIN_MB + 10),
                         "step_end": stat(BEGIN_MB + 10), "activations": stat(act_mb)},
        "reserved_mb": stat(reserved_mb), "peak_allocated_mb": peak_mb, "peak_reserved_mb": reserved_mb,
        "peak_phase": "backward", "peak_step": 1, "alloc_retries": 0, "device_total_mb": 81559.0,
        "device_free_mb": 79000.0, "creep": None, "step_begin_points": [[s, BEGIN_MB] for s in MEM_STEPS[2:]],
        "stopped": None, "device_error": None,
    }


def write_tensorboard_run(path: Path, *, peak_mb: float | None = 1410.0, steps: int = 40, window: int = 5) -> Path:
    """A run's real event file: window scalars of four phases, and memory points (``peak_mb`` None: no memory)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(path)) as w:
        for end in range(window, steps + 1, window):
            w.add_scalar("phase_timer/window_steps", float(window), end)
            for phase, ms in (("forward", 5.0), ("backward", 9.0), ("step", 15.0), ("period", 16.0)):
                for stat in ("mean", "p50", "p90", "max"):
                    w.add_scalar(f"phase_time/{phase}_ms/{stat}", ms, end)
        for i, step in enumerate(MEM_STEPS if peak_mb is not None else ()):
            w.add_scalar("phase_memory/step_begin_mb", FIRST_MB if i < 2 else BEGIN_MB, step)
            w.add_scalar("phase_memory/activations_mb", ACT_MB, step)
            w.add_scalar("phase_memory/peak_allocated_mb", peak_mb - 100 * (len(MEM_STEPS) - 1 - i), step)  # rising
            w.add_scalar("phase_memory/peak_reserved_mb", 2048.0, step)
    return path


def with_memory(summary_run: dict, dest: Path, memory: dict | None) -> Path:
    """The real run's summary file alone in ``dest``, its ``memory`` replaced (and checked against the schema)."""
    import jsonschema

    from phase_timer.outputs.run_summary import schema

    dest.mkdir()
    data = json.loads(summary_run["file"].read_text())
    data["memory"] = memory
    jsonschema.validate(data, schema())
    (dest / "phase_timer_summary.json").write_text(json.dumps(data))
    return dest


def png_height(path: Path) -> int:
    import matplotlib.image

    return matplotlib.image.imread(str(path)).shape[0]


def test_memory_from_tensorboard_is_reported_and_said_to_be(tmp_path, capsys):
    run = write_tensorboard_run(tmp_path / "tb")
    code, out, err = report(capsys, run)
    assert code == 0, err
    block = next(line for line in out.splitlines() if line.startswith("memory"))
    assert "from TensorBoard's phase_memory/*" in block
    # the mean leaves out the first two points (before the optimizer's state); the peaks are the last points
    assert "at the step's begin 1.22 GiB" in block and "activations 100 MiB" in block
    assert "peak allocated 1.38 GiB, peak reserved 2.00 GiB" in block
    mem = report_json(capsys, run)["runs"][0]["memory"]
    assert mem["source"] == "tensorboard" and mem["samples"] == len(MEM_STEPS)
    assert mem["allocated_mb"]["step_begin"] == {"mean": BEGIN_MB, "max": BEGIN_MB}
    assert mem["peak_allocated_mb"] == 1410.0 and mem["peak_reserved_mb"] == 2048.0


def test_memory_from_the_summary_file_is_the_runs_own_block(summary_run, tmp_path, capsys):
    from phase_timer.outputs.table import format_memory

    planted = planted_memory()
    run = with_memory(summary_run, tmp_path / "cuda_run", planted)
    code, out, err = report(capsys, run)
    assert code == 0, err
    assert format_memory(planted) in out  # the block the run printed
    assert "peak allocated 1.38 GiB in backward (step 1)" in out
    assert report_json(capsys, run)["runs"][0]["memory"] == planted


def test_a_run_without_memory_says_nothing_about_memory(runs, summary_run, capsys):
    assert json.loads(summary_run["file"].read_text())["memory"] is None  # a CPU run: memory absent
    for run in (runs["window"], summary_run["dir"]):
        code, out, err = report(capsys, run)
        assert code == 0, err
        assert not any(line.startswith("memory") for line in out.splitlines())
        assert "peak allocated" not in out and " 0 MiB" not in out
        assert report_json(capsys, run)["runs"][0]["memory"] is None


def test_side_by_side_shows_the_peak_where_a_run_has_memory(runs, tmp_path, capsys):
    run = write_tensorboard_run(tmp_path / "tb")
    code, out, err = report(capsys, run, runs["window"])
    assert code == 0, err
    row = next(line for line in out[out.index("side by side"):].splitlines() if line.startswith("peak allocated"))
    assert row.split()[2:] == ["1.38", "GiB"]  # the run without memory: blank, not zero


def test_png_gets_a_memory_panel_only_with_memory_data(runs, summary_run, tmp_path, capsys):
    from phase_timer.cli.report_runs import load_runs

    heights = {}
    tb = write_tensorboard_run(tmp_path / "tb")
    alone = with_memory(summary_run, tmp_path / "summary_only", planted_memory())
    for name, run in (("none", runs["window"]), ("tensorboard", tb), ("summary", alone)):
        png = tmp_path / f"{name}.png"
        code, _, err = report(capsys, run, "--png", png)
        assert code == 0, err
        assert png.read_bytes()[:8] == PNG_MAGIC
        heights[name] = png_height(png)
    # 15 x (3 + 3 per run) inches at 110 dpi; a memory panel adds a 3-inch row, and so does the throughput panel
    # of the Lightning runs (they count their batches; the planted TensorBoard run has no throughput/* points)
    assert heights == {"none": 990, "tensorboard": 990, "summary": 1320}
    (from_tb,), (from_file,) = load_runs([str(tb)]), load_runs([str(alone)])
    assert from_tb.memory_from == "TensorBoard"
    assert [s for s, _ in from_tb.memory_timeline["step_begin"]] == list(MEM_STEPS)
    assert from_file.memory_from == "phase_timer_summary.json"
    assert from_file.memory_timeline["step_begin"] == [(s, BEGIN_MB) for s in MEM_STEPS[2:]]
    assert from_file.memory_timeline["peak_allocated"] == [(3, 1410.0), (35, 1410.0)]  # the peak, flat


# -- several runs ----------------------------------------------------------------------------
def test_two_runs_side_by_side(runs, capsys):
    code, out, err = report(capsys, runs["root"])  # a parent dir: both runs found
    assert code == 0, err
    assert f"run: {runs['window']}" in out and f"run: {runs['step']}" in out
    side = out[out.index("side by side (2 runs)") :]
    assert "version_0" in side and "version_1" in side
    forward = next(line for line in side.splitlines() if line.startswith("forward")).split()
    assert len(forward) == 5  # phase, then "mean (share)" for each run
    doc = report_json(capsys, runs["step"], runs["window"])  # the order given is kept
    assert [r["run"] for r in doc["runs"]] == [str(runs["step"]), str(runs["window"])]
    assert [r["source"] for r in doc["runs"]] == ["step", "window"]


def test_same_run_twice_is_reported_once(runs, capsys):
    doc = report_json(capsys, runs["window"], runs["window"].parent)
    assert [r["run"] for r in doc["runs"]] == [str(runs["window"]), str(runs["step"])]


def test_truncated_last_record_is_tolerated(runs, tmp_path, capsys):
    """A run still being written ends in a partial record: TensorBoard reads up to it, so do we."""
    run = tmp_path / "live"
    shutil.copytree(runs["window"], run)
    (path,) = event_files(str(run))
    os.truncate(path, os.path.getsize(path) - 5)
    doc = report_json(capsys, run)
    assert doc["runs"][0]["windows"] >= STEPS // WINDOW - 1


# -- figure ------------------------------------------------------------------------------
def test_png_is_written(runs, tmp_path, capsys):
    png = tmp_path / "phases.png"
    code, out, err = report(capsys, runs["window"], runs["step"], "--png", png)
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(png)).shape
    assert width > 1000 and height > 500
    assert "forward" in out and str(png) in err  # tables still printed; the note goes to stderr


def test_a_phase_has_one_colour_in_every_figure():
    from phase_timer.cli.report_plot import _phase_colors

    few, many = _phase_colors(["forward", "step"]), _phase_colors(["data_wait", "h2d", "forward", "ema", "step"])
    assert few["forward"] == many["forward"] and few["step"] == many["step"] == "black"
    assert len({many[p] for p in ("data_wait", "h2d", "forward", "ema")}) == 4


def test_png_with_json_keeps_stdout_json(runs, tmp_path, capsys):
    png = tmp_path / "one.png"
    doc = report_json(capsys, runs["window"], "--png", png)
    assert doc["runs"][0]["source"] == "window" and png.read_bytes()[:8] == PNG_MAGIC


def test_png_unwritable(runs, tmp_path, capsys):
    target = tmp_path / "no" / "such" / "dir" / "x.png"
    code, _, err = report(capsys, runs["window"], "--png", target)
    assert code == 2 and str(target) in err and "Traceback" not in err


# -- errors ---------------------------------------------------------------------------------
def _non_phase_timer_run(path: Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(path)) as w:
        for step in range(3):
            w.add_scalar("loss", 1.0 / (step + 1), step)
    return path


def _corrupt_run(path: Path) -> Path:
    path.mkdir()
    (path / "events.out.tfevents.1700000000.host.123.0").write_bytes(os.urandom(4096))
    return path


BAD_DIRS = {
    "missing": (lambda p: p / "nope", "no such directory"),
    "a file": (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "not a directory"),
    "empty": (lambda p: (p / "empty").mkdir() or p / "empty", "no TensorBoard event files"),
    "not phase-timer": (lambda p: _non_phase_timer_run(p / "other"), "no phase-timer scalars"),
    "corrupt": (lambda p: _corrupt_run(p / "corrupt"), "corrupt event file"),
}


@pytest.mark.parametrize("kind", list(BAD_DIRS))
def test_bad_log_dir(kind, tmp_path, capsys):
    make, message = BAD_DIRS[kind]
    bad = make(tmp_path)
    code, out, err = report(capsys, bad)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(bad) in err and message in err


def test_one_bad_dir_among_good_ones_fails(runs, tmp_path, capsys):
    bad = _corrupt_run(tmp_path / "corrupt")
    code, out, err = report(capsys, runs["window"], bad)
    assert code == 2 and out == "" and str(bad) in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["report"])
    assert exc.value.code == 2


def test_help_says_how_window_columns_are_made(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0
    for phrase in ("mean of window means", "median of window p50", "max of window p90", "max of window max"):
        assert phrase in out


# -- the command, as a user runs it ------------------------------------------------------------
@pytest.mark.timeout(120)
def test_module_command(runs, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "phase_timer.cli.report", str(runs["root"]), "--json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [r["source"] for r in json.loads(proc.stdout)["runs"]] == ["window", "step"]
