"""Timing a user can trust in odd places (issue 48): a user's forward pre-hook, a step given a closure."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import nn

import phase_timer

pytestmark = pytest.mark.timeout(300)


def _plain(tmp_path, model: nn.Module, steps: int = 24):  # noqa: ANN001, ANN202
    opt = torch.optim.SGD(model.parameters(), 0.01)
    data = [torch.randn(4, 8) for _ in range(steps)]
    with phase_timer.attach(model, opt, data, log_dir=tmp_path, warmup_steps=2, summary=False) as timer:
        for x in timer.loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return {p: t.mean for p, t in timer.totals.phases.items()}


def test_a_forward_pre_hook_registered_before_attach_is_forward(tmp_path) -> None:
    """The hook was timed as h2d (5.56 ms, and H2D_BOUND's advice) when registered before attach, as forward
    when after: forward begins where the model's call begins, whatever the order."""
    model = nn.Linear(8, 8)
    model.register_forward_pre_hook(lambda m, a: time.sleep(0.005))
    before = _plain(tmp_path / "before", model)
    assert before["forward"] >= 5.0 and before["h2d"] < 1.0, before


def test_a_closure_given_to_step_runs_the_steps_forward_and_backward(tmp_path) -> None:
    """LBFGS's pattern, ``opt.step(closure)`` with no backward before it: the closure's forward and backward are
    forward and backward, the optimizer's time is the rest; no warning of a step without backward."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    data = [torch.randn(4, 8) for _ in range(24)]

    def closure(x):  # noqa: ANN001, ANN202
        opt.zero_grad()
        time.sleep(0.003)  # the loop's own work before the model's call: h2d (the optimizer's, were step() begun)
        loss = model(x).sum()
        time.sleep(0.004)  # in forward (after the model's call, before backward)
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with phase_timer.attach(model, opt, data, log_dir=tmp_path, warmup_steps=2, summary=False) as timer:
            for x in timer.loader:
                opt.step(lambda: closure(x))
    phases = {p: t.mean for p, t in timer.totals.phases.items()}
    assert phases["forward"] >= 4.0 and phases["h2d"] >= 3.0 and phases["optimizer"] < 2.0, phases
    assert timer.totals.phases["backward"].count == 22
    assert not [w for w in seen if "no `backward()` call seen" in str(w.message)]


def test_lightning_manual_optimization_with_a_closure_times_its_forward_and_backward(tmp_path) -> None:
    """Lightning's documented manual pattern, ``opt.step(closure=closure)``: the closure's forward was counted
    under optimizer, with a warning that no backward was seen."""
    pl = pytest.importorskip("lightning.pytorch")
    from phase_timer import PhaseTimer
    from tests.helpers import loader, trainer

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.lin = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            opt = self.optimizers()

            def closure():  # noqa: ANN202
                loss = nn.functional.mse_loss(self.lin(batch[0]), batch[1])
                time.sleep(0.004)  # in forward
                opt.zero_grad()
                self.manual_backward(loss)
                return loss

            opt.step(closure=closure)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), 0.01)

    timer = PhaseTimer(warmup_steps=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=24).fit(Manual(), loader())
    phases = {p: t.mean for p, t in timer.totals.phases.items()}
    assert phases["forward"] >= 4.0 and phases["optimizer"] < 2.0, phases
    assert timer.totals.phases["backward"].count == 22
    assert not [w for w in seen if "no `backward()` call seen" in str(w.message)]


def test_a_closure_after_the_steps_backward_is_the_optimizers(tmp_path) -> None:
    """SAM's pattern: backward, then ``step(closure)`` whose closure re-evaluates the loss: the optimizer's."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    data = [torch.randn(4, 8) for _ in range(24)]
    with phase_timer.attach(model, opt, data, log_dir=tmp_path, warmup_steps=2, summary=False) as timer:
        for x in timer.loader:
            model(x).sum().backward()

            def again():  # noqa: ANN202
                time.sleep(0.004)
                return model(x).sum()

            opt.step(again)
            opt.zero_grad()
    phases = {p: t.mean for p, t in timer.totals.phases.items()}
    assert phases["optimizer"] >= 4.0 and phases["forward"] < 2.0, phases
