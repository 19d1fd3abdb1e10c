"""Recorded runs (``tests/golden_runs.py``): each writes today exactly what it wrote when recorded.

A change of phase-timer's insides (issue 49's redesign, a clean-up, a faster path) must leave every output of a
fixed run as it was: the summary file, every TensorBoard scalar, the table.  A change that means to change an
output records the runs again (``python -m tests.golden_runs --update``) and says why in its commit.
"""

from __future__ import annotations

import json
import os

import pytest

import golden_runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(golden_runs.RUNS))
def test_a_recorded_run_writes_what_it_wrote(name: str) -> None:
    path = os.path.join(golden_runs.GOLDEN, f"{name}.json")
    with open(path) as fh:
        want = json.load(fh)
    got = json.loads(json.dumps(golden_runs.record(name), sort_keys=True))
    diff = golden_runs.differences(want, got)
    assert not diff, f"{len(diff)} differences from {path}:\n" + "\n".join(diff[:40])
    assert want["scalars"] and want["summary"]["phases"]  # the record holds what it says


def test_the_comparison_sees_a_changed_figure() -> None:
    with open(os.path.join(golden_runs.GOLDEN, "plain.json")) as fh:
        want = json.load(fh)
    got = json.loads(json.dumps(want))
    tag = sorted(got["scalars"])[0]
    got["scalars"][tag][0][1] += 1e-6
    got["summary"]["phases"]["forward"]["mean_ms"] += 0.001
    assert len(golden_runs.differences(want, got)) == 2
