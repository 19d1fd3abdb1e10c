from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from tests.helpers import HostHours


def pytest_report_header(config: pytest.Config) -> str:
    """The code under test, as git names it: a results file of the GPU suite says which code it ran on."""
    from benchmarks.provenance import code_line

    return code_line()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_disable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHASE_TIMER_DISABLE", raising=False)
    os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.fixture
def host_hours(monkeypatch: pytest.MonkeyPatch) -> HostHours:
    """The host clock on :class:`~tests.helpers.HostHours`; the helpers' planted waits an hour per millisecond.

    For tests that say where time lands: the planted hours are exact, whatever the machine's load.
    """
    clock = HostHours()
    monkeypatch.setattr(time, "perf_counter_ns", clock)
    for name in ("tests.helpers", "helpers"):  # tests/ is on the path too (the torchrun scripts import `helpers`)
        module = sys.modules.get(name)
        if module is not None:
            monkeypatch.setattr(module, "pause", lambda seconds: clock.jump(1000 * seconds))
    return clock
