"""The doors' shared arguments are written once (``phase_timer/doors/options.py``): each door's signature, checks and
docstring agree with that one definition, and each door keeps what is its own."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.doors.door import RESULTS
from phase_timer.doors.options import Options, entries

#: Each door: what it is called in errors, its constructor, its name for the window, and the words of its docs.
DOORS = {
    "PhaseTimer": ("log_every_n_steps", dict(run="each ``fit``", end="the end of ``fit``")),
    "attach": ("window", dict(run="the run", end="``close()``")),
    "PhaseTimerCallback": ("window", dict(run="each ``train()``", end="the end of ``train()``")),
}
SHARED = [f for f in dataclasses.fields(Options) if "check" in f.metadata]


def door(name: str) -> Any:
    if name == "PhaseTimerCallback":
        pytest.importorskip("transformers")
    if name == "PhaseTimer":
        pytest.importorskip("lightning")
    return getattr(phase_timer, name)


def signature(name: str) -> inspect.Signature:
    obj = door(name)
    return inspect.signature(obj if inspect.isfunction(obj) else obj.__init__)


def make(name: str, **kwargs: Any) -> Any:
    if name == "attach":
        model = nn.Linear(2, 1)
        return phase_timer.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), **{"summary": False, **kwargs})
    return door(name)(**kwargs)


@pytest.mark.parametrize("name", DOORS)
def test_each_door_takes_every_shared_argument_with_its_default_and_type(name):
    window, _ = DOORS[name]
    params = signature(name).parameters
    for f in SHARED:
        arg = window if f.name == "window" else f.name
        assert arg in params, (name, arg)
        p = params[arg]
        assert p.kind is p.KEYWORD_ONLY, (name, arg)
        if (name, f.name) == ("attach", "window"):  # the plain door has no framework to take a window from
            assert (p.default, p.annotation) == (50, "int")
            continue
        assert p.default == f.default, (name, arg, p.default, f.default)
        assert p.annotation == f.type, (name, arg, p.annotation, f.type)


@pytest.mark.parametrize("name", DOORS)
def test_each_door_documents_every_shared_argument_in_the_one_text(name):
    doc = " ".join(inspect.getdoc(door(name)).split())
    for entry in entries(**DOORS[name][1]):
        assert " ".join(entry.split()) in doc, (name, entry[:60])
        assert doc.count(f" {entry.split(':')[0]}: ") == 1, (name, entry[:60])
    assert "{options}" not in doc and "{results}" not in doc


@pytest.mark.parametrize("name", ["PhaseTimer", "LoopTimer", "PhaseTimerCallback"])
def test_each_door_documents_every_result_in_the_one_text(name):
    doc = " ".join(inspect.getdoc(door(name)).split())
    for result, words in RESULTS.items():
        assert f"{result}: {' '.join(words.split())}" in doc, (name, result)


BAD = {
    "window": 0, "warmup_steps": -1, "max_pending": "8", "per_step": 1, "summary": None, "nvtx": "on", "log_dir": 3,
    "trace_steps": (2, 1), "trace_path": "", "rank_timeout_s": float("inf"), "memory": "yes",
    "samples_per_batch": -1, "tokens_per_batch": 2.5, "flops_per_step": {"forward": 1.0}, "peak_tflops": 0,
    "mfu": "no", "memory_snapshot": 3, "enabled": "yes", "modules": 0,
}


@pytest.mark.parametrize("field", [f.name for f in SHARED])
@pytest.mark.parametrize("name", DOORS)
def test_a_wrong_shared_argument_fails_at_construction_naming_the_door_and_the_argument(name, field):
    window, _ = DOORS[name]
    arg = window if field == "window" else field
    with pytest.raises(ValueError, match=rf"^{name}\({arg}=.*: `{arg}` must be .*, got "):
        make(name, **{arg: BAD[field]})


def test_every_shared_argument_has_a_wrong_value_to_try():
    assert set(BAD) == {f.name for f in SHARED}


def test_the_options_are_what_the_door_was_given():
    timer = make("attach", window=7, warmup_steps=0, enabled=False)
    assert (timer.config.window, timer.config.warmup_steps, timer.config.owner) == (7, 0, "attach")
    assert timer.totals is not None and timer.totals.steps == 0  # disabled: empty results, no run
    lightning = make("PhaseTimer", log_every_n_steps=3)
    assert (lightning.config.window, lightning.config.window_arg) == (3, "log_every_n_steps")


def test_the_options_document_themselves():
    doc = inspect.getdoc(Options)
    for f in SHARED:
        if f.metadata["doc"]:
            assert re.search(rf"^    {f.name}: ", doc, flags=re.M), f.name
