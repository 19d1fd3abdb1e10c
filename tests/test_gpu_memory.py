"""Memory per phase on a real CUDA device (issue 27), both doors, against the allocator's truth.

The runs are ``benchmarks/memory_truth.py``'s (its docstring says how the truth is read); each test
prints its figures (``MEMORY`` lines); ``python -m benchmarks.memory_truth`` prints the same cases as a table,
recorded in ``benchmarks/results/memory_truth_h100.txt``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DOORS = ["plain", "lightning"]


@pytest.mark.parametrize("door", DOORS)
def test_activations_agree_with_the_allocators_synced_truth_within_1_percent(door):
    from benchmarks.memory_truth import activations_case

    r = activations_case(door)
    print(f"MEMORY {door} activations", {k: round(v, 2) for k, v in r.items()})
    assert r["truth_activations"] > 100  # MB: the LM keeps real activations for backward
    for key in ("forward_begin", "backward_begin", "activations"):
        assert r[key] == pytest.approx(r[f"truth_{key}"], rel=0.01), key


@pytest.mark.parametrize("plant", ["forward", "optimizer"])
@pytest.mark.parametrize("door", DOORS)
def test_a_planted_512_mb_temporary_is_the_peak_of_its_phase(door, plant):
    from benchmarks.memory_truth import peak_case

    r = peak_case(door, plant)
    print(f"MEMORY {door} peak", r)
    assert r["truth_phase"] == plant  # the planted temporary does set the run's peak (the case is meaningful)
    assert r["phase"] == plant


@pytest.mark.parametrize("door", DOORS)
def test_a_leak_of_8_mb_a_step_is_creep_within_100_steps_and_its_absence_is_not(door):
    from benchmarks.memory_truth import LEAK_MB, creep_case

    leak, steady = creep_case(door, True), creep_case(door, False)
    print(f"MEMORY {door} creep", leak, steady)
    assert leak["creep"] and leak["rate"] == pytest.approx(LEAK_MB, rel=0.1)
    assert not steady["creep"] and abs(steady["rate"]) < 0.1


def test_the_users_max_memory_allocated_is_unchanged_by_the_timer():
    from benchmarks.memory_truth import peak_unchanged_case

    r = peak_unchanged_case()
    print("MEMORY max_memory_allocated", r)
    assert r["with"] == r["without"] == r["without_again"]


def test_reading_memory_adds_no_sync_in_the_profilers_trace():
    from benchmarks.memory_truth import syncs_case

    r = syncs_case()
    print("MEMORY syncs", r)
    assert r["memory"] == r["no_memory"]
