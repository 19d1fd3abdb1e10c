"""The benchmarks' truth for exposed communication (``benchmarks/nccl_truth.py``) on hand-made timelines: what the
profiler's union-of-intervals rule must say, annotations and all."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.nccl_truth import exposed_us, per_step  # noqa: E402

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def k(a, b, name="void gemm()", kind="kernel"):
    return (float(a), float(b), name, kind)


def test_an_annotation_over_the_same_interval_as_its_kernel_counts_once():
    """ProcessGroupNCCL's GPU-side annotation nccl:all_reduce spans its kernel: counted, it doubles the time."""
    tl = [k(0, 1, "spin_kernel"), k(10, 100), k(100, 1100, NCCL), k(100, 1100, "nccl:all_reduce", "annotation"),
          k(1100, 1300, "Memcpy DtoD (Device -> Device)", "memcpy"), k(2000, 2001, "spin_kernel")]
    (row,) = per_step(tl)[:1]
    assert row["exposed_stream"] == pytest.approx(1.0)  # 1000 us of NCCL, nothing else beside it
    assert row["comm"] == pytest.approx(1.0)
    assert row["copies"] == pytest.approx(0.2)
    assert row["copies_run"] == pytest.approx(0.2)


def test_copies_back_to_back_count_the_queued_gaps_between_them_not_the_host_s():
    d = "Memcpy DtoD (Device -> Device)"
    tl = [k(0, 1, "spin_kernel"), k(100, 101, d, "memcpy"), k(102.3, 103.3, d, "memcpy"),  # queued: 1.3 us apart
          k(113.3, 114.3, d, "memcpy"),  # 10 us later: launched by a host behind the device, not counted
          k(500, 501, "spin_kernel")]
    row = per_step(tl)[0]
    assert row["copies"] == pytest.approx(0.003)
    assert row["copies_run"] == pytest.approx(0.0043)


def test_copies_beside_a_collective_hide_it_on_the_stream_rule_not_the_analyzers():
    tl = [k(0, 1, "spin_kernel"), k(0, 100), k(100, 600, NCCL), k(200, 300, "Memcpy DtoD (Device -> Device)", "memcpy"),
          k(1000, 1001, "spin_kernel")]
    row = per_step(tl)[0]
    assert row["exposed_stream"] == pytest.approx(0.4)  # 500 us of NCCL less the 100 us copy beside it
    assert row["exposed"] == pytest.approx(0.5)  # compute kernels only: the copy hides nothing


def test_steps_are_cut_at_the_markers_and_overlapping_collectives_count_once():
    tl = [k(0, 1, "spin_kernel"), k(50, 150, NCCL), k(100, 200, NCCL),  # two collectives overlapping: 150 us
          k(1000, 1001, "spin_kernel"), k(1000, 1100), k(1050, 1400, NCCL),  # half hidden: 300 us exposed
          k(2000, 2001, "spin_kernel"), k(1900, 2300, NCCL), k(2300, 2500)]  # crosses the marker: cut there
    rows = per_step(tl)
    assert [round(r["exposed_stream"], 3) for r in rows] == [0.15, 0.4, 0.3]
    assert [round(r["comm"], 3) for r in rows] == [0.15, 0.45, 0.3]
    assert per_step([k(0, 10, NCCL)]) == []  # no marker: no step


def test_exposed_us_is_the_union_of_comm_outside_the_union_of_work():
    assert exposed_us([(0, 10), (5, 20)], [(2, 4), (3, 6), (15, 30)]) == pytest.approx(20 - 4 - 5)
    assert exposed_us([], [(0, 1)]) == 0.0


def test_a_collective_beside_the_stream_s_launch_gaps_is_hidden_once_those_gaps_are_filled():
    """Queued kernels 2 us apart: the strict rule counts the collective in the gaps, the queued rule does not; a
    real idle gap (20 us: the stream waits) stays exposed in both."""
    tl = [k(0, 1, "spin_kernel"), k(100, 150, NCCL)]
    tl += [k(90 + 12 * i, 100 + 12 * i) for i in range(6)]  # 10 us kernels, 2 us apart, 90..160
    tl += [k(200, 210), k(230, 240), k(205, 225, NCCL), k(1000, 1001, "spin_kernel")]
    row = per_step(tl)[0]
    assert row["exposed_stream"] == pytest.approx((5 * 2 + 15) / 1e3)  # 5 launch gaps beside it, and 210..225
    assert row["exposed_queued"] == pytest.approx(15 / 1e3)  # the idle gap alone


def test_a_long_spin_is_work_not_a_marker():
    """phase-timer's own spin before a sampled backward's copies is a spin kernel too: not a step's start."""
    tl = [k(0, 1, "spin_kernel"), k(100, 400, "spin_kernel"), k(300, 500, NCCL), k(1000, 1001, "spin_kernel")]
    rows = per_step(tl)
    assert len(rows) == 2 and rows[0]["exposed_stream"] == pytest.approx(0.1)  # the spin hides 300..400


def test_exposed_where_splits_the_exposed_time_by_the_timer_s_spans() -> None:
    from benchmarks.nccl_truth import exposed_where

    iv = [(0, 1, "spin_kernel", "kernel"), (10, 20, "gemm", "kernel"),
          (20, 21, "bitwise_not", "kernel"), (21, 30, "ncclDevKernel_AllGather", "kernel"),  # a wait, marked
          (30, 31, "logical_not", "kernel"), (31, 40, "gemm", "kernel"),
          (40, 50, "ncclDevKernel_ReduceScatter", "kernel"), (50, 60, "gemm", "kernel"),  # exposed, unmarked
          (60, 61, "spin_kernel", "kernel"), (61, 70, "gemm", "kernel"),
          (70, 80, "ncclDevKernel_AllGather", "kernel"), (100, 110, "gemm", "kernel")]  # then idle 20 us
    first, second = exposed_where(iv, "bitwise_not", "logical_not")
    assert first["inside"] == pytest.approx(0.009) and first["outside"] == pytest.approx(0.010)
    assert first["kinds"] == {"ReduceScatter": pytest.approx(0.010)}
    assert first["longest"] == (0.01, "gemm", "gemm")
    assert first["then_idle"] == 0  # the work after each interval starts at its end: the stream was waiting
    assert second["inside"] == 0 and second["outside"] == pytest.approx(0.010)
    assert second["then_idle"] == pytest.approx(0.010)  # nothing ran for 20 us after it: the host's gap
