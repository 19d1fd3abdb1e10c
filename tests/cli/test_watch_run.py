"""``phase-timer watch`` and ``phase-timer run`` on real runs: a Lightning Trainer and a 🤗 Trainer (a tiny GPT-2
from a config) on the CPU, started as scripts that have no phase-timer in them (``tests/run_scripts/``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("rich")

from phase_timer.cli import main  # noqa: E402
from phase_timer.cli.launch import OPTIONS  # noqa: E402
from phase_timer.cli.watch_state import newest_run, read_state  # noqa: E402
from phase_timer.doors.options import Options  # noqa: E402
from phase_timer.outputs.live import LIVE_NAME  # noqa: E402
from phase_timer.outputs.run_summary import FILE_NAME  # noqa: E402

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "run_scripts"


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}


def _run(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(), cwd=cwd,
                          timeout=timeout)


def _phase_timer(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return _run("-m", "phase_timer.cli", *args, cwd=cwd)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / FILE_NAME).read_text())


def _same_run(by_hand: Path, by_run: Path) -> None:
    """The two summary files say the same of the run's shape: its phases and its steps (not its timings)."""
    hand, run = _summary(by_hand), _summary(by_run)
    assert list(run["phases"]) == list(hand["phases"])
    assert {p: v["count"] for p, v in run["phases"].items()} == {p: v["count"] for p, v in hand["phases"].items()}
    assert run["steps"] == hand["steps"]
    assert run["door"] == hand["door"]
    same_dir = lambda cfg: {**cfg, "log_dir": cfg["log_dir"] and os.path.basename(cfg["log_dir"])}  # noqa: E731
    assert same_dir(run["config"]) == same_dir(hand["config"])
    assert run["windows"]["steps"] == hand["windows"]["steps"]


def _watch_once(run_dir: Path) -> str:
    out = _phase_timer("watch", str(run_dir), "--once")
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lightning")
    hand = _run(str(SCRIPTS / "lightning_train.py"), str(root / "hand"), "--by-hand")
    assert hand.returncode == 0, hand.stderr[-3000:]
    run = _phase_timer("run", "--warmup-steps", "2", "--", sys.executable, str(SCRIPTS / "lightning_train.py"),
                       str(root / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "script: done" in run.stdout  # the script's own output is there
    return root / "hand/lightning_logs/version_0", root / "run/lightning_logs/version_0"


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    hand = _run(str(SCRIPTS / "hf_train.py"), str(root / "hand"), "--by-hand")
    assert hand.returncode == 0, hand.stderr[-3000:]
    run = _phase_timer("run", "--warmup-steps", "2", "--", sys.executable, str(SCRIPTS / "hf_train.py"),
                       str(root / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "hand/phase-timer-logs/version_0", root / "run/phase-timer-logs/version_0"


def test_run_on_an_unmodified_lightning_script_writes_what_the_callback_by_hand_writes(lightning_runs):
    _same_run(*lightning_runs)


def test_run_on_an_unmodified_hf_script_writes_what_the_callback_by_hand_writes(hf_runs):
    _same_run(*hf_runs)


@pytest.mark.parametrize("runs", ["lightning_runs", "hf_runs"])
def test_watch_once_on_a_finished_run_prints_phases_throughput_and_verdict(runs, request):
    run_dir = request.getfixturevalue(runs)[1]
    verdict = _summary(run_dir)["diagnosis"]["kind"]
    out = _watch_once(run_dir)
    assert "ended" in out
    for phase in ("data_wait", "forward", "backward", "optimizer", "step", "period"):
        assert f"\n{phase} " in out, out
    assert "samples/s" in out and "throughput" in out
    assert f"verdict: {verdict} " in out
    assert "own host time" in out


def test_watch_svg_writes_the_frame_as_an_image(lightning_runs, tmp_path):
    svg = tmp_path / "frame.svg"
    out = _phase_timer("watch", str(lightning_runs[1]), "--svg", str(svg))
    assert out.returncode == 0, out.stderr
    assert "\nforward " in out.stdout  # the frame is printed too
    text = svg.read_text()
    assert text.lstrip().startswith("<svg") and "forward" in text and "verdict" in text
    bad = _phase_timer("watch", str(lightning_runs[1]), "--svg", str(tmp_path / "no" / "such" / "frame.svg"))
    assert bad.returncode == 2 and "--svg: cannot write" in bad.stderr


def test_the_live_file_ends_with_the_runs_verdict(lightning_runs):
    live = json.loads((lightning_runs[1] / LIVE_NAME).read_text())
    summary = _summary(lightning_runs[1])
    assert live["status"] == "ended"
    assert live["verdict"]["kind"] == summary["diagnosis"]["kind"] and live["verdict"]["final"]
    assert live["windows"] == len(summary["windows"]["steps"])
    assert live["totals"]["step"]["steps"] == summary["steps"]["timed"]


def test_watch_shows_successive_windows_of_a_live_run(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "lightning_train.py"), str(tmp_path), "--by-hand",
                             "--steps", "400", "--sleep-ms", "80"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    run_dir = tmp_path / "lightning_logs/version_0"
    seen: list[tuple[str, int]] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            state = read_state(str(run_dir)) if run_dir.is_dir() else None
            if state is not None and state.status == "running" and (not seen or state.windows != seen[-1][1]):
                out = _watch_once(run_dir)  # the command's own frame of that window
                assert "running" in out and "forward" in out, out
                seen.append((out, state.windows))
                if len(seen) >= 2:
                    break
            time.sleep(0.2)
    finally:  # a window about every second: two seen, the rest is not needed
        proc.terminate()
        proc.wait(timeout=60)
    assert len(seen) >= 2, seen
    assert seen[1][1] > seen[0][1]
    frames = [re.search(r"running step (\d+), (\d+) windows?", " ".join(out.split())) for out, _ in seen]
    assert all(frames), seen
    assert int(frames[1][1]) > int(frames[0][1]) and int(frames[1][2]) > int(frames[0][2])


def test_watch_waits_for_a_first_window_and_says_when_the_directory_is_gone(tmp_path):
    assert read_state(str(tmp_path)).status == "waiting"
    (tmp_path / LIVE_NAME).write_text(json.dumps({"schema": "phase-timer/live", "status": "running", "windows": 0}))
    assert read_state(str(tmp_path)).status == "waiting"
    gone = read_state(str(tmp_path / "deleted"))
    assert gone.status == "gone" and "deleted" in gone.note


def test_watch_without_log_dir_takes_the_newest_run(tmp_path, monkeypatch, capsys):
    old, new = tmp_path / "lightning_logs/version_0", tmp_path / "out/runs/Nov27_host"
    for d, t in ((old, 1_000_000), (new, 2_000_000)):
        d.mkdir(parents=True)
        (d / LIVE_NAME).write_text(json.dumps({"schema": "phase-timer/live", "status": "running", "windows": 0}))
        os.utime(d / LIVE_NAME, (t, t))
    monkeypatch.chdir(tmp_path)
    assert newest_run() == os.path.join("out", "runs", "Nov27_host")
    assert main(["watch", "--once"]) == 0
    assert "waiting for its first window" in capsys.readouterr().out


def test_a_bad_log_dir_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "nope"), "--once"]) == 2
    assert capsys.readouterr().err.strip() == f"phase-timer watch: error: {tmp_path / 'nope'}: no such directory"
    (tmp_path / "file").write_text("")
    assert main(["watch", str(tmp_path / "file"), "--once"]) == 2
    assert "not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chdir(empty)
    try:
        assert main(["watch", "--once"]) == 2
    finally:
        os.chdir(REPO)
    assert "no run found" in capsys.readouterr().err


def test_run_keeps_a_failing_scripts_output_and_status():
    out = _phase_timer("run", "--", sys.executable, "-c", "import sys; print('mine'); sys.exit(5)")
    assert out.returncode == 5
    assert out.stdout == "mine\n"
    assert out.stderr.strip().endswith("exited with status 5")
    missing = _phase_timer("run", "--", "no-such-command-here")
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_run_checks_its_options_before_the_script_starts():
    out = _phase_timer("run", "--window", "0", "--", sys.executable, "-c", "print('ran')")
    assert out.returncode == 2 and "ran" not in out.stdout
    assert "window" in out.stderr


def test_run_leaves_no_phase_timer_in_unrelated_processes_and_says_a_plain_script_was_not_timed():
    out = _phase_timer("run", "--", sys.executable, str(SCRIPTS / "probe.py"))
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout.split("probe ", 1)[1])
    assert probe["hook"] and not probe["env"]
    assert probe["child"] == {"hook": False, "env": False}
    assert "built no Lightning or 🤗 Trainer and its loop was not timed (no optimizer stepped twice)" in out.stderr


def _loop_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    out = _phase_timer("run", "--warmup-steps", "2", "--log-dir", str(tmp_path / "run"), "--", sys.executable,
                       str(SCRIPTS / "loop_train.py"), *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "script: done" in out.stdout
    return out


def test_run_times_a_hand_written_loop_from_its_third_step(tmp_path):
    out = _loop_run(tmp_path, "--steps", "30")
    assert "timed the hand-written loop from its third step (Net with AdamW)" in out.stderr
    assert "never closed" not in out.stderr  # run closes the timer it attached
    summary = _summary(tmp_path / "run" / "version_0")
    assert summary["door"] == "loop"  # attach()'s own
    assert summary["steps"]["timed"] == 30 - 2 - 2  # two watched, two of warm-up
    for phase in ("forward", "backward", "optimizer", "step"):
        assert summary["phases"][phase]["count"] == 26, phase
    frame = _watch_once(tmp_path / "run" / "version_0")  # the plain door's run, in watch too
    assert "\nforward " in frame and "verdict: " in frame and "ended" in frame


def test_run_times_a_loop_of_two_models_and_two_optimizers_as_one_step(tmp_path):
    out = _loop_run(tmp_path, "--gan", "--steps", "30")
    # the discriminator's optimizer steps first: the step ends after the generator's
    assert "(Sequential, Sequential with Adam, SGD)" in out.stderr
    summary = _summary(tmp_path / "run" / "version_0")
    assert summary["steps"]["timed"] == 26 and summary["phases"]["optimizer"]["count"] == 26


@pytest.mark.parametrize("case, why", [
    ("--by-hand", "a timer was open already"),
    ("--hidden", "no module the loop holds has the optimizer's parameters"),
])
def test_run_says_why_a_loop_was_not_timed(tmp_path, case, why):
    out = _loop_run(tmp_path, case, "--steps", "8")
    assert f"its loop was not timed ({why}" in out.stderr
    assert not (tmp_path / "run").exists()


def test_under_torchrun_each_training_process_gets_the_hook():
    out = _phase_timer("run", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       str(SCRIPTS / "probe.py"))
    assert out.returncode == 0, out.stderr[-2000:]
    probes = sorted((json.loads(line[len("probe "):]) for line in out.stdout.splitlines() if line.startswith("probe ")),
                    key=lambda p: p["rank"])
    assert [p["rank"] for p in probes] == ["0", "1"]
    assert all(p["hook"] and not p["env"] and p["child"] == {"hook": False, "env": False} for p in probes)


def test_under_accelerate_launch_the_training_process_gets_the_hook(tmp_path):
    """``accelerate launch`` is a launcher: it keeps run's variables, and the script it starts (a process of its
    own) builds a 🤗 Trainer that gets the callback."""
    pytest.importorskip("accelerate")
    out = _phase_timer("run", "--warmup-steps", "2", "--", sys.executable, "-m", "accelerate.commands.launch", "--cpu",
                       "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                       "no", str(SCRIPTS / "hf_train.py"), str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "script: done" in out.stdout
    summary = _summary(tmp_path / "out" / "phase-timer-logs" / "version_0")
    assert summary["door"] == "transformers" and summary["steps"]["timed"] == 30 - 2


def test_watch_shows_the_ranks_of_a_ddp_run_that_run_timed(tmp_path):
    """Lightning's DDP on two CPU processes (gloo; its launcher runs the script again): run gives both the
    callback, and watch shows the ranks' spread, the slowest rank and the job's throughput."""
    out = _phase_timer("run", "--warmup-steps", "2", "--window", "10", "--", sys.executable,
                       str(SCRIPTS / "lightning_train.py"), str(tmp_path), "--ddp", "--steps", "40", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert _summary(run_dir)["environment"]["world_size"] == 2
    frame = _watch_once(run_dir)
    assert "across 2 ranks" in frame and "slowest rank" in frame and "job (all ranks)" in frame, frame
    assert "\nbackward.comm_wait " in frame


def test_run_options_are_the_doors_argument_names():
    cli_only = {"enabled", "owner", "window_arg"}  # not a choice of the command line (a timer it runs is on)
    assert set(OPTIONS) == {f.name for f in fields(Options)} - cli_only
