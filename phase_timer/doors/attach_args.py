"""What ``attach()`` takes besides the shared options (:mod:`phase_timer.doors.options`), checked before anything
is hooked: the models, the optimizers, the loader, the device, a writer, how a step ends and a scaler.

Each wrong argument fails as the shared ones do (:func:`phase_timer.config._fail`): a ValueError
that repeats the call, says what the argument must be and what it got.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phase_timer.config import _fail, check_bool

#: Where a step ends: at the optimizers' step (or the scaler's update), or at ``timer.end_step()``.
END_STEP = ("optimizer", "manual")


def no_end_hint(end_step: str) -> str:
    """What the table says where no step ended, by how a step ends."""
    if end_step == "manual":
        return "call timer.end_step() where each step ends (end_step='manual')"
    return ("the attached optimizers' step() never ran; attach the optimizer the loop steps (an optimizer that steps "
            "another is followed through its `base_optimizer`), or use end_step='manual'")


def models_and_optimizers(models: Any, optimizers: Any) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The models and the optimizers, each one or a list of them (no optimizer: ``end_step="manual"``)."""
    if isinstance(models, torch.optim.Optimizer) and isinstance(optimizers, nn.Module):
        _fail("attach", "model", models, "an nn.Module or a list of them",
              ": the model and the optimizer are swapped, attach(model, optimizer)")
    optimizers = () if optimizers is None else optimizers
    return (_checked_list(models, nn.Module, "model", "an nn.Module or a list of them"),
            _checked_list(optimizers, torch.optim.Optimizer, "optimizer",
                          "a torch.optim.Optimizer, a list of them, or None with end_step='manual'", empty_ok=True))


def _checked_list(value: Any, kind: type, name: str, expected: str, *, empty_ok: bool = False) -> list[Any]:
    """``value`` as a list of ``kind`` (one, or a list or tuple of them), or a ValueError naming it as given."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, kind) for v in value) and (value or empty_ok):
        return list(value)
    _fail("attach", name, value, expected)


def check_attach(optimizers: list[Any], loader: Any, device: Any, writer: Any, end_step: Any, scaler: Any,
                 copy: Any) -> None:
    """The rest of attach()'s own arguments, together: some rule out others."""
    check_bool("attach", "copy_to_device", copy)
    if end_step not in END_STEP:
        _fail("attach", "end_step", end_step, f"one of {END_STEP}")
    if end_step == "optimizer" and not optimizers and scaler is None:
        _fail("attach", "optimizer", optimizers or None, "given: a step ends at its step(); or pass "
              "end_step='manual' and call timer.end_step()")
    if loader is not None and (isinstance(loader, (str, bytes)) or not hasattr(loader, "__iter__")):
        _fail("attach", "loader", loader, "an iterable of batches (a DataLoader) or None")
    if copy and loader is None:
        _fail("attach", "copy_to_device", copy, "False without a loader", " (there is no batch to copy)")
    _check_device(device)
    if writer is not None and not callable(getattr(writer, "add_scalar", None)):
        _fail("attach", "writer", writer, "a torch.utils.tensorboard.SummaryWriter or None")
    if scaler is not None:
        if not isinstance(scaler, torch.amp.GradScaler):
            _fail("attach", "scaler", scaler, "a torch.amp.GradScaler or None")
        if end_step != "optimizer":
            _fail("attach", "scaler", scaler, "None with end_step='manual'",
                  " (the scaler only ends steps at its update(); with end_step='manual' you end them)")


def _check_device(device: Any) -> None:
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        _fail("attach", "device", device, "a torch.device, a device string such as 'cuda:0', or None", f" ({err})")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            _fail("attach", "device", device, "a device this machine has", " (CUDA is not available)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            _fail("attach", "device", device, "a device this machine has",
                  f" (it has {torch.cuda.device_count()} CUDA device(s))")
