"""The Lightning door leaves the user's project and Lightning as they were (issue 25, item 3).

Each check runs in a fresh interpreter: what is imported, and what a run leaves in its
working directory, are the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

_TRAIN = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.lin(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

def data():
    return DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)
"""


def run(code: str, cwd: Path, *, head: str = "") -> str:
    """``head`` (what is imported first), then a small LightningModule ``Net`` and ``data()`` for ``pl``, then ``code``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    source = textwrap.dedent(head) + (_TRAIN if head else "") + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", source], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


@pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])
def test_only_the_namespace_the_user_imported_is_imported(tmp_path, ns):
    other = "pytorch_lightning" if ns == "lightning.pytorch" else "lightning.pytorch"
    out = run(f"""
        import sys
        import phase_timer
        from phase_timer import PhaseTimer
        timer = PhaseTimer(summary=False)
        assert isinstance(timer, pl.Callback) and isinstance(timer, PhaseTimer)
        pl.Trainer(max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[timer]).fit(Net(), data())
        assert timer.totals.steps == 7, timer.totals.steps
        print("other imported:", "{other}" in sys.modules)
    """, tmp_path, head=f"import {ns} as pl")
    assert "other imported: False" in out


def test_importing_phase_timer_leaves_lightnings_loggers_as_they_were(tmp_path):
    """A user who quiets ``lightning.pytorch`` still has it quiet with the callback in."""
    out = run("""
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
        from phase_timer import PhaseTimer
        pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[PhaseTimer(summary=False)]).fit(Net(), data())
        print("done")
    """, tmp_path, head="import logging\nlogging.basicConfig(level=logging.INFO)\nimport lightning.pytorch as pl\n")
    assert "done" in out and "GPU available" not in out and "TPU available" not in out


def test_debug_and_logger_free_runs_leave_nothing_behind(tmp_path):
    run("""
        from phase_timer import PhaseTimer
        pl.Trainer(fast_dev_run=4, enable_progress_bar=False, callbacks=[PhaseTimer(summary=False)]).fit(Net(), data())
        pl.Trainer(max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   callbacks=[PhaseTimer(summary=False)]).fit(Net(), data())
    """, tmp_path, head="import lightning.pytorch as pl\n")
    assert os.listdir(tmp_path) == []


def test_the_default_log_dir_can_never_shadow_a_package(tmp_path):
    """A run's own files beside the user's script: the next run's ``import phase_timer`` still finds us.

    ``./phase_timer/version_0`` (Lightning's old default, with ``logger=False``) was taken for a
    namespace package before an editable install's finder was asked.  No default folder may be a
    Python identifier.
    """
    run("""
        import phase_timer
        from phase_timer import PhaseTimer
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with phase_timer.attach(model, opt, data(), summary=False) as timer:
            for x, y in timer.loader:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        pl.Trainer(max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   callbacks=[PhaseTimer(summary=False)]).fit(Net(), data())
    """, tmp_path, head="import lightning.pytorch as pl\n")
    made = sorted(os.listdir(tmp_path))
    assert imports_from(tmp_path).endswith(os.path.join("phase_timer", "__init__.py")), made
    assert made and not [name for name in made if name.isidentifier()], made


def test_the_shadowing_check_sees_a_shadow(tmp_path):
    """What the check above guards against, as users met it: ``./phase_timer/version_0`` hides us."""
    (tmp_path / "phase_timer" / "version_0").mkdir(parents=True)
    with pytest.raises(AssertionError, match="cannot import name 'PhaseTimer'"):
        imports_from(tmp_path)


def imports_from(folder: Path) -> str:
    """The next run of a script in ``folder``: ``from phase_timer import PhaseTimer``; where it came from.

    As under an editable install: ``folder`` first on ``sys.path``, this checkout not on it, and the
    package found by a finder asked after ``sys.path``'s entries (which a namespace package beats).
    """
    code = f"""
import importlib.abc, importlib.util, os, sys
class Editable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "phase_timer":
            pkg = {str(ROOT / "phase_timer")!r}
            return importlib.util.spec_from_file_location(name, os.path.join(pkg, "__init__.py"),
                                                          submodule_search_locations=[pkg])
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != {str(ROOT)!r}]
sys.meta_path.append(Editable())
from phase_timer import PhaseTimer
import phase_timer
print(phase_timer.__file__)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def test_a_timer_kept_after_the_fit_keeps_no_model_alive(tmp_path):
    """Lightning binds each callback's ``log``/``log_dict`` to the module's; a timer kept to read its results
    (a sweep keeps one per run) must not keep the model, its gradients and its optimizer's state alive with them."""
    out = run("""
        import gc, weakref
        from phase_timer import PhaseTimer
        timer, net = PhaseTimer(summary=False), Net()
        trainer = pl.Trainer(max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[timer])
        trainer.fit(net, data())
        alive = weakref.ref(net)
        del trainer, net
        gc.collect()
        print("steps", timer.totals.steps, "model alive:", alive() is not None)
    """, tmp_path, head="import lightning.pytorch as pl")
    assert "steps 7 model alive: False" in out
