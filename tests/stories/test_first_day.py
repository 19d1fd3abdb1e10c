"""A newcomer's first day: every door timed without TensorBoard, nothing measured lost on a fault,
without ``close()``, on SIGTERM or with the log directory deleted, one line per crash, one API.

Each test follows a path a user took (issue 36) on real pieces: real processes for exit and signals,
a real ``transformers.Trainer``, a real Lightning ``Trainer``, the summary file read back.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.timing.stats import RunTotals
from tests.helpers import event_files, read_scalars

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: A plain loop of 40 steps (a script's body; ``LOG`` is the log directory).
PLAIN_LOOP = """
import torch, phase_timer
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), 0.01)
loader = [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(40)]
"""


def run_script(body: str, tmp_path: Any, *, block_tensorboard: bool = False, env: dict | None = None,
               timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``body`` as a script of its own (``LOG`` = ``tmp_path/logs``); without tensorboard if asked:
    ``import tensorboard`` then fails as it does where the package is not installed."""
    # a script that hangs prints every thread's stack and ends before the test's timeout: its output says where
    head = f"import sys, faulthandler\nfaulthandler.dump_traceback_later({max(timeout - 30, 10)}, exit=True)\n"
    if block_tensorboard:
        head += "sys.modules['tensorboard'] = None  # as if not installed: `import tensorboard` raises ImportError\n"
    head += f"LOG = {str(tmp_path / 'logs')!r}\n"
    script = tmp_path / "script.py"
    script.write_text(head + textwrap.dedent(body))
    full_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("PHASE_TIMER_DISABLE", None)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=str(tmp_path), preexec_fn=_as_from_a_terminal)


def _as_from_a_terminal() -> None:
    """The child's signals as a shell starts a program: none blocked, SIGINT's default (Python then installs its
    KeyboardInterrupt).  A library in this long pytest process can leave SIGINT blocked or ignored, and a child
    inherits both across exec: the full suite's Ctrl+C test then trained on, its presses never delivered."""
    import signal

    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def summary_in(path: Any) -> dict:
    with open(os.path.join(path, "phase_timer_summary.json")) as f:
        return json.load(f)


# -- 1. timed without tensorboard ----------------------------------------------------------
def test_the_plain_door_times_without_tensorboard_and_says_which_extra_writes_it(tmp_path):
    out = run_script(PLAIN_LOOP + """
with phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=2, window=10) as timer:
    for x, y in timer.loader:
        opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
print("STEPS", timer.totals.steps)
""", tmp_path, block_tensorboard=True)
    assert out.returncode == 0, out.stderr
    assert "STEPS 38" in out.stdout
    assert "verdict:" in out.stdout and "forward" in out.stdout  # the table and the verdict
    assert out.stderr.count("pip install 'phase-timer[tensorboard]'") == 1  # said once
    summary = summary_in(tmp_path / "logs" / "version_0")
    assert summary["steps"]["timed"] == 38 and summary["interrupted"] is False
    assert not event_files(str(tmp_path / "logs"))
    assert "files: TensorBoard values not written" in out.stdout


def test_the_hf_door_times_without_tensorboard(tmp_path):
    pytest.importorskip("transformers")
    out = run_script("""
from tests.doors.test_hf_trainer import trainer
from phase_timer import PhaseTimerCallback
import pathlib
cb = PhaseTimerCallback(warmup_steps=2)
trainer(pathlib.Path(LOG), cb, steps=24).train()
print("STEPS", cb.totals.steps, cb.summary_path)
""", tmp_path, block_tensorboard=True)
    assert out.returncode == 0, out.stderr
    assert "STEPS 22" in out.stdout, out.stdout + out.stderr
    assert "not timed" not in out.stderr
    assert out.stderr.count("pip install 'phase-timer[tensorboard]'") == 1
    assert summary_in(tmp_path / "logs" / "phase-timer-logs" / "version_0")["steps"]["timed"] == 22


def test_the_lightning_door_times_without_tensorboard(tmp_path):
    pytest.importorskip("lightning")
    out = run_script("""
import lightning.pytorch as pl
from tests.helpers import module_class, loader
from phase_timer import PhaseTimer
timer = PhaseTimer(warmup_steps=2, log_dir=LOG)
pl.Trainer(max_steps=24, logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False, callbacks=[timer]).fit(module_class("lightning.pytorch")(), loader())
print("STEPS", timer.totals.steps)
""", tmp_path, block_tensorboard=True)
    assert out.returncode == 0, out.stderr
    assert "STEPS 22" in out.stdout, out.stdout + out.stderr
    assert out.stderr.count("pip install 'phase-timer[tensorboard]'") == 1
    assert summary_in(tmp_path / "logs")["steps"]["timed"] == 22


def test_every_door_extra_brings_tensorboard():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for door in ("lightning", "pytorch-lightning", "transformers"):
        assert any(dep.startswith("tensorboard") for dep in extras[door]), door


def test_the_wheel_holds_every_package_and_its_data(tmp_path):
    """``pip install phase-timer`` (a wheel, not this editable checkout) imports every subpackage: a wheel built from
    the project's files holds each folder of ``phase_timer/`` that has an ``__init__.py``, and the package data; the
    sdist holds the C extension's parts (``_native.c`` includes them: without them a source install builds no C,
    silently, as the extension is optional)."""
    import glob
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "phase_timer"), src / "phase_timer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("phase_timer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = [os.path.relpath(d, ROOT) for d, _, files in os.walk(os.path.join(ROOT, "phase_timer"))
                if "__init__.py" in files]
    assert len(packages) > 5
    for package in packages:
        assert f"{package}/__init__.py" in names, package
    for data in ("phase_timer/py.typed", "phase_timer/summary_schema.json", "phase_timer/cli/boot/sitecustomize.py"):
        assert data in names, data
    import tarfile

    proc = subprocess.run([sys.executable, "-c", "from setuptools import build_meta; build_meta.build_sdist('sdist')"],
                          cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sdist,) = (src / "sdist").glob("phase_timer-*.tar.gz")
    members = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    parts = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "phase_timer", "native", "*.c")))
    assert len(parts) > 5 and "phase_timer/_native.c" in members
    for part in parts:
        assert part in members, part


# -- 2. nothing lost: the 🤗 door's faults -------------------------------------------------
def _hf_fault(tmp_path: Any, where: str, exc: BaseException) -> Any:
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    from tests.doors.test_hf_trainer import trainer

    class Raises(TrainerCallback):
        def __init__(self) -> None:
            self.steps = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.steps += 1
            if where == "on_step_end" and self.steps == 12:
                raise exc

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if where == "on_optimizer_step" and self.steps == 12:
                raise exc

    cb = phase_timer.PhaseTimerCallback(warmup_steps=2, summary=False)
    tr = trainer(tmp_path, cb, steps=40)
    tr.add_callback(Raises())
    if where == "floating_point_ops":
        calls = {"n": 0}
        real = tr.floating_point_ops

        def floating_point_ops(inputs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 12:
                raise exc
            return real(inputs)

        tr.floating_point_ops = floating_point_ops
    backward = torch.autograd.backward
    with pytest.raises(type(exc)) as raised:
        tr.train()
    assert raised.value is exc  # the user's exception, unchanged
    assert torch.autograd.backward is backward  # every hook and patch put back
    assert "_inner_training_loop" in tr.__dict__ and "training_step" not in tr.__dict__
    return cb


@pytest.mark.parametrize("where", ["on_step_end", "on_optimizer_step", "floating_point_ops"])
def test_the_hf_door_writes_what_it_measured_whatever_raises_in_the_loop(tmp_path, where):
    cb = _hf_fault(tmp_path, where, RuntimeError(f"raised in {where}"))
    assert cb.totals is not None and cb.totals.steps >= 5
    summary = summary_in(cb.summary_path and os.path.dirname(cb.summary_path))
    assert summary["interrupted"] is True and summary["steps"]["timed"] == cb.totals.steps
    assert "(interrupted)" in cb.last_summary


def test_a_keyboard_interrupt_in_a_hf_callback_is_written_and_goes_on(tmp_path):
    cb = _hf_fault(tmp_path, "on_step_end", KeyboardInterrupt())
    assert summary_in(cb.log_dir)["interrupted"] is True


def test_the_hf_callback_has_every_doors_results(tmp_path):
    pytest.importorskip("transformers")
    from tests.doors.test_hf_trainer import trainer

    cb = phase_timer.PhaseTimerCallback(warmup_steps=2, summary=False)
    assert cb.totals is None and cb.diagnosis is None and cb.syncs == ()
    trainer(tmp_path, cb, steps=12).train()
    timer = cb.timer
    for name in ("totals", "diagnosis", "summary_path", "log_dir", "last_summary", "syncs", "sync_census"):
        assert getattr(cb, name) is getattr(timer, name), name
    assert cb.totals.steps == 10 and os.path.isfile(cb.summary_path)


# -- 2. nothing lost: no close(), SIGTERM, a deleted directory ------------------------------
def test_a_plain_loop_never_closed_is_written_at_exit_with_a_warning(tmp_path):
    out = run_script(PLAIN_LOOP + """
timer = phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=2, window=10)
for x, y in timer.loader:
    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
print("LOOP DONE")
""", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("the timer was never closed") == 1 and "at interpreter exit" in out.stderr
    summary = summary_in(tmp_path / "logs" / "version_0")
    assert summary["steps"]["timed"] == 38 and summary["interrupted"] is False
    scalars = read_scalars(str(tmp_path / "logs" / "version_0"))
    assert scalars["phase_timer/window_steps"][-1][0] == 39  # the last window too
    assert out.stdout.index("LOOP DONE") < out.stdout.index("phase-timer: 38 steps timed")


def test_an_uncaught_exception_without_close_is_written_as_interrupted(tmp_path):
    out = run_script(PLAIN_LOOP + """
timer = phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=2, window=10)
for i, (x, y) in enumerate(timer.loader):
    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
    if i == 25:
        raise ValueError("the user's own error")
""", tmp_path)
    assert out.returncode == 1 and "ValueError: the user's own error" in out.stderr
    assert summary_in(tmp_path / "logs" / "version_0")["interrupted"] is True


def test_a_timer_collected_without_close_is_written_once(tmp_path):
    def train() -> str:
        model = nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(30)]
        timer = phase_timer.attach(model, opt, loader, log_dir=tmp_path / "logs", warmup_steps=2, summary=False)
        for x, y in timer.loader:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        return timer.log_dir  # the loop, the model and the timer are dropped here, never closed

    backward = torch.autograd.backward
    with pytest.warns(RuntimeWarning, match="never closed.*garbage collected"):
        log_dir = train()
        gc.collect()
    assert summary_in(log_dir)["steps"]["timed"] == 28
    assert torch.autograd.backward is backward  # its wrapper went with it


def test_sigterm_writes_the_run_and_then_ends_the_process_as_it_would(tmp_path):
    out = run_script(PLAIN_LOOP + """
import os, signal
timer = phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=2, window=10)
for i, (x, y) in enumerate(timer.loader):
    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
    if i == 30:
        os.kill(os.getpid(), signal.SIGTERM)
print("NOT REACHED")
""", tmp_path)
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stderr)  # killed by the signal, as without us
    assert "NOT REACHED" not in out.stdout
    summary = summary_in(tmp_path / "logs" / "version_0")
    assert summary["interrupted"] is True and summary["steps"]["timed"] >= 20


def test_sigterm_chains_to_the_programs_own_handler(tmp_path):
    out = run_script(PLAIN_LOOP + """
import os, signal
def mine(signum, frame):
    print("MY HANDLER", flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, mine)
timer = phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=2, window=10)
for i, (x, y) in enumerate(timer.loader):
    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
    if i == 30:
        os.kill(os.getpid(), signal.SIGTERM)
""", tmp_path)
    assert out.returncode == 3 and "MY HANDLER" in out.stdout, out.stderr
    assert summary_in(tmp_path / "logs" / "version_0")["interrupted"] is True


def test_the_sigterm_handler_is_put_back_when_the_run_closes():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    before = signal.getsignal(signal.SIGTERM)
    timer = phase_timer.attach(model, opt, [torch.randn(2, 4)], summary=False, log_dir=None)
    assert signal.getsignal(signal.SIGTERM) is not before
    timer.close()
    assert signal.getsignal(signal.SIGTERM) is before
    shutil.rmtree(timer.log_dir, ignore_errors=True)


def test_a_log_directory_deleted_mid_run_is_said_once_and_written_again(tmp_path):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(60)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with phase_timer.attach(model, opt, loader, log_dir=tmp_path / "logs", warmup_steps=0, window=10,
                                summary=False) as timer:
            for i, (x, y) in enumerate(timer.loader):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                if i == 30:
                    shutil.rmtree(tmp_path / "logs")
    deleted = [w for w in seen if "was deleted during the run" in str(w.message)]
    assert len(deleted) == 1
    assert summary_in(timer.log_dir)["steps"]["timed"] == 60  # the summary file in the directory made again
    scalars = read_scalars(timer.log_dir)
    assert scalars["phase_timer/window_steps"][-1][0] == 59  # the last windows in a new file there


# -- 4. messages: one line for a crash, where the files went -------------------------------
def test_a_crash_on_the_first_step_says_one_short_line(tmp_path):
    out = run_script(PLAIN_LOOP + """
with phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=0) as timer:
    for x, y in timer.loader:
        ((model(x) - y) ** 2).mean().backward()
        raise RuntimeError("boom")
""", tmp_path)
    text = out.stdout + out.stderr
    assert "RuntimeError: boom" in out.stderr
    assert text.count("interrupted before its first step ended") == 1
    assert "attach the optimizer" not in text and "end_step" not in text


def test_the_end_says_where_the_files_went(tmp_path, capsys):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(12)]
    with phase_timer.attach(model, opt, loader, log_dir=tmp_path / "logs", warmup_steps=2) as timer:
        for x, y in timer.loader:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"files: TensorBoard values in {timer.log_dir}; summary {timer.summary_path}"
    assert os.path.isfile(timer.summary_path)


# -- 4. a disabled timer's results exist, and are empty ------------------------------------
def test_a_disabled_timer_has_empty_results_in_every_door(monkeypatch):
    monkeypatch.setenv("PHASE_TIMER_DISABLE", "1")
    model = nn.Linear(4, 1)
    timer = phase_timer.attach(model, torch.optim.SGD(model.parameters(), 0.1), [torch.randn(2, 4)])
    assert isinstance(timer.totals, RunTotals) and timer.totals.steps == 0
    timer.close()
    assert isinstance(timer.totals, RunTotals) and timer.totals.steps == 0
    if pytest.importorskip("lightning"):
        assert phase_timer.PhaseTimer().totals.steps == 0
    if pytest.importorskip("transformers"):
        assert phase_timer.PhaseTimerCallback().totals.steps == 0


# -- 4. Lightning manual optimization with a raw loss.backward() ---------------------------
def test_lightning_manual_optimization_times_a_raw_backward(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tests.helpers import loader

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))

        def training_step(self, batch: Any, idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            loss.backward()  # not self.manual_backward(loss)
            opt.step()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), 0.01)

    timer = phase_timer.PhaseTimer(warmup_steps=2, summary=False)
    backward = torch.autograd.backward
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pl.Trainer(max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[timer]).fit(Manual(), loader())
    assert not [w for w in seen if "no `backward()` call seen" in str(w.message)]
    assert timer.totals.steps == 18 and timer.totals.phases["backward"].count == 18
    assert torch.autograd.backward is backward


def test_a_real_sigint_during_hf_training_is_written(tmp_path):
    """Ctrl+C at a moment the test does not choose (a thread sends SIGINT after a while): written, interrupted."""
    pytest.importorskip("transformers")
    out = run_script("""
import os, signal, threading, time, pathlib
from tests.doors.test_hf_trainer import trainer
from phase_timer import PhaseTimerCallback
from transformers import TrainerCallback

STEP = [0]

class Later(TrainerCallback):  # Ctrl+C from another thread, 0.3 s after the 10th step: wherever the loop is then
    def on_step_end(self, args, state, control, **kw):
        STEP[0] = state.global_step
        if state.global_step == 10:
            threading.Thread(target=press, daemon=True).start()

def press():
    # again while training goes on, as a user would: CPython drops a KeyboardInterrupt raised inside a
    # finalizer ("Exception ignored in ..."), wherever that finalizer runs, so one press may land where no code
    # sees it; once one took (no more steps), no more
    time.sleep(0.3)
    while True:
        at = STEP[0]
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        if STEP[0] <= at + 1:
            return

cb = PhaseTimerCallback(warmup_steps=2)
tr = trainer(pathlib.Path(LOG), cb, steps=100000)
tr.add_callback(Later())
try:
    tr.train()
except KeyboardInterrupt:
    print("INTERRUPTED", cb.totals.steps)
""", tmp_path)
    assert "INTERRUPTED" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert summary_in(tmp_path / "logs" / "phase-timer-logs" / "version_0")["interrupted"] is True


def test_a_forked_worker_that_gets_sigterm_leaves_the_parents_run_alone(tmp_path):
    """A DataLoader worker is forked after attach and inherits the handler: SIGTERM ends it as by default, and
    its copy of the run (stale, the parent's) is never written."""
    out = run_script(PLAIN_LOOP + """
import os, signal
timer = phase_timer.attach(model, opt, loader, log_dir=LOG, warmup_steps=2, window=10, summary=False)
pid = os.fork()
if pid == 0:
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(7)  # never reached: the signal ends the child
_, status = os.waitpid(pid, 0)
written = os.path.exists(os.path.join(timer.log_dir, "phase_timer_summary.json"))
print("CHILD", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, written)
timer.close()
""", tmp_path)
    assert "CHILD True False" in out.stdout, out.stdout + out.stderr
