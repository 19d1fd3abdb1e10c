"""The benchmarks' truth for exposed communication (``benchmarks/nccl_truth.py``) on hand-made timelines: what the
profiler's union-of-intervals rule must say, annotations and all, and the blocked rule beside it."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.nccl_truth import compute_stream, exposed_us, per_step, per_step_blocked  # noqa: E402

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
    assert row["copies_queued"] == pytest.approx(0.5)  # of the two gaps, one a queued stream's


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


# The blocked rule: activities (start, end, name, kind, stream, correlation id) and the host's launches (correlation
# id -> µs). Stream 7 computes (the markers run there), stream 20 holds NCCL's kernels.
COMPUTE, COMM = 7, 20


def act(a, b, corr, name="void gemm()", kind="kernel", stream=COMPUTE):
    return (float(a), float(b), name, kind, stream, corr)


def timeline(launch_b, b_start, *extra):
    """marker, a kernel to 100, NCCL 100..600 on its own stream, then kernel B (launched at ``launch_b``, starting at
    ``b_start``) for 100 us, and the next step's marker at 2000 (launched just before it)."""
    acts = [act(0, 1, 1, "spin_kernel"), act(10, 100, 2), act(100, 600, 3, NCCL, stream=COMM),
            act(b_start, b_start + 100, 4), act(2000, 2001, 5, "spin_kernel"), *extra]
    return acts, {1: -5.0, 2: 5.0, 3: 60.0, 4: float(launch_b), 5: 1990.0}


def test_a_host_paced_gap_beside_a_collective_is_not_blocked():
    """(a) B is launched after the collective ends: the stream waited for the host, not for NCCL; the union rule
    counts the 500 us, the blocked rule none."""
    acts, launches = timeline(690, 700)
    row = per_step_blocked(acts, launches)[0]
    union = per_step([a[:4] for a in acts])[0]
    assert union["exposed_stream"] == pytest.approx(0.5) and union["exposed_queued"] == pytest.approx(0.5)
    assert row["queued"] == pytest.approx(0.5)
    assert row["blocked"] == 0 and row["unmatched"] == 0


def test_a_wait_on_a_collective_with_the_next_kernel_queued_counts_in_full():
    """(b) B is launched at 50, before the gap: the stream is blocked from 100 to 600 by the collective."""
    acts, launches = timeline(50, 600)
    row = per_step_blocked(acts, launches)[0]
    union = per_step([a[:4] for a in acts])[0]
    assert union["exposed_stream"] == pytest.approx(0.5) and union["exposed_queued"] == pytest.approx(0.5)
    assert row["blocked"] == pytest.approx(0.5) and row["queued"] == pytest.approx(0.5)


def test_a_gap_partly_host_paced_counts_only_from_the_launch_on():
    """(c) B is launched at 300, mid-collective, and waits for it to end at 600: from its launch and the device's
    launch latency (3 us) on, 303..600, is blocked."""
    acts, launches = timeline(300, 600)
    row = per_step_blocked(acts, launches)[0]
    assert row["queued"] == pytest.approx(0.5)
    assert row["blocked"] == pytest.approx(0.297)
    assert per_step_blocked(acts, launches, latency=0.0)[0]["blocked"] == pytest.approx(0.3)


def test_a_host_paced_stream_s_launch_latency_beside_a_spinning_collective_is_not_blocked():
    """A rank waiting for its peer: a collective spins through a host-paced stretch whose kernels each start 2 us
    after the host's call returns (the device's own launch latency, there without a collective too) and run 5 us,
    one every 20 us: no wait of the stream, none blocked; at latency 0 every launch's 2 us would count.  A kernel
    queued behind the collective (launched at 500, it starts at its end, 1000) still counts from its launch's
    latency on."""
    acts = [act(0, 1, 1, "spin_kernel"), act(10, 20, 2), act(20, 1000, 3, NCCL, stream=COMM)]
    launches = {1: -5.0, 2: 5.0, 3: 15.0}
    for i in range(20):
        launches[10 + i] = 40.0 + 20 * i
        acts.append(act(42 + 20 * i, 47 + 20 * i, 10 + i))
    acts += [act(1000, 1100, 50), act(2000, 2001, 51, "spin_kernel")]
    launches |= {50: 500.0, 51: 1990.0}
    row = per_step_blocked(acts, launches)[0]
    assert row["blocked"] == pytest.approx(0.497)  # 503..1000: the queued kernel's wait alone
    assert per_step_blocked(acts, launches, latency=0.0)[0]["blocked"] == pytest.approx(0.497 + 0.003 + 20 * 0.002)


def test_annotations_neither_double_count_the_collective_nor_fill_the_compute_stream_s_gap():
    """(d) ProcessGroupNCCL's GPU-side nccl:all_reduce over its kernel's interval, on the kernel's stream and on the
    compute stream (where a torch puts it): counted once, and no activity of the compute stream."""
    extra = (act(100, 600, 6, "nccl:all_reduce", "annotation", COMM),
             act(100, 600, 7, "nccl:all_reduce", "annotation", COMPUTE),
             act(0, 2001, 8, "FSDP::post_backward", "annotation", COMPUTE))
    acts, launches = timeline(50, 600, *extra)
    row = per_step_blocked(acts, launches)[0]
    assert row["blocked"] == pytest.approx(0.5) and row["queued"] == pytest.approx(0.5)
    assert per_step([a[:4] for a in acts])[0]["comm"] == pytest.approx(0.5)


def test_the_blocked_rule_keeps_the_queued_rule_s_work_and_launch_gaps():
    """Another stream's copy beside the collective hides it (work, as in the union rule); the compute stream's 2 us
    launch gaps beside a collective count in neither rule; the steps are the markers'."""
    acts, launches = timeline(50, 600, act(200, 300, 9, "Memcpy DtoD (Device -> Device)", "memcpy", 30))
    launches[9] = 150.0
    row = per_step_blocked(acts, launches)[0]
    assert row["blocked"] == pytest.approx(0.4) and row["queued"] == pytest.approx(0.4)
    queued = [act(0, 1, 1, "spin_kernel"), act(95, 1100, 2, NCCL, stream=COMM), act(1500, 1501, 99, "spin_kernel")]
    queued += [act(90 + 12 * i, 100 + 12 * i, 10 + i) for i in range(6)]  # 10 us kernels 2 us apart, all launched early
    rows = per_step_blocked(queued, {c: 0.0 for c in [1, 2, 99, *range(10, 16)]})
    assert len(rows) == 2
    assert rows[0]["queued"] == pytest.approx(0.94)  # 160..1100: the kernels' gaps filled
    assert rows[0]["blocked"] == pytest.approx(0.94)


def test_a_gap_with_no_launch_found_counts_as_the_union_rule_counts_it_and_is_reported():
    acts, launches = timeline(50, 600)
    del launches[4]
    row = per_step_blocked(acts, launches)[0]
    assert row["blocked"] == pytest.approx(0.5) and row["unmatched"] == pytest.approx(0.5)
    assert per_step_blocked([a for a in acts if "spin" not in a[2]], launches) == []  # no marker: no step


def test_a_wait_queued_on_the_compute_stream_blocks_it_where_the_profile_holds_the_waits():
    """CUPTI's Stream Wait Event (a synchronization record, at the host's call): B is launched late (690, after the
    collective), but the compute stream's wait on the collective was queued at 150: ``waited`` counts 150..600, the
    blocked rule none; a wait on another stream, or queued before the launch of the kernel before the gap, counts
    not; the records are no activities (they neither close a gap nor hide the collective)."""
    sync = "Stream Wait Event"
    acts, launches = timeline(690, 700, act(148, 150, 6, sync, "sync"), act(120, 122, 7, sync, "sync", 30))
    row = per_step_blocked(acts, launches)[0]
    assert row["blocked"] == 0 and row["waited"] == pytest.approx(0.45) and row["queued"] == pytest.approx(0.5)
    assert per_step([a[:4] for a in acts if a[3] != "sync"])[0]["exposed_stream"] == pytest.approx(0.5)
    early, launches = timeline(690, 700, act(2, 4, 6, sync, "sync"))  # queued before the kernel at 10 (launched at 5)
    assert per_step_blocked(early, launches)[0]["waited"] == 0
    assert "waited" not in per_step_blocked(*timeline(690, 700))[0]  # no records: no such rule


def test_the_compute_stream_is_the_markers_stream():
    """Kernel B on another stream does not end the compute stream's gap: its next activity is the marker at 2000,
    launched at 1990, so 100..600 was the host's (the compute stream had nothing queued)."""
    acts, launches = timeline(50, 600)
    acts[3] = act(600, 700, 4, stream=40)
    assert compute_stream(acts) == COMPUTE
    assert per_step_blocked(acts, launches)[0]["blocked"] == 0


def test_activities_and_launches_are_read_off_the_profiler_s_events():
    """``prof.events()`` as torch 2.11 gives them with CUDA activity alone: each kernel with its stream
    (``device_resource_id``) and CUPTI's correlation id (``id``), each runtime or driver call a CPU-side event with
    the same id; an op's own id (another counter) is no launch; with ``enable_cuda_sync_events`` a stream's wait is a
    device-side record on that stream."""
    from types import SimpleNamespace

    import torch

    from benchmarks.nccl_truth import device_activities, device_intervals, launch_times

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, device, corr, a, b, res):
        return SimpleNamespace(name=name, device_type=device, id=corr, time_range=SimpleNamespace(start=a, end=b),
                               device_resource_id=res, is_user_annotation=False)

    events = [ev("cudaLaunchKernel", cpu, 3, 10.0, 20.0, 1234), ev("cuLaunchKernel", cpu, 20, 30.0, 35.0, 1234),
              ev("cudaDeviceSynchronize", cpu, 40, 36.0, 90.0, 1234), ev("aten::mm", cpu, 21, 29.0, 36.0, 1234),
              ev("spin_kernel", cuda, 3, 19.0, 20.0, 7), ev("void cutlass::Kernel2<x>", cuda, 20, 36.0, 80.0, 7),
              ev("nccl:all_reduce", cuda, 5, 40.0, 60.0, 13), ev(NCCL, cuda, 6, 40.0, 60.0, 13),
              ev("Stream Wait Event", cuda, 41, 37.0, 38.0, 7)]
    assert launch_times(events) == {3: 20.0, 20: 35.0, 40: 90.0}
    assert launch_times(events, at="start")[20] == 30.0
    acts = device_activities(events)
    assert acts[1] == (36.0, 80.0, "void cutlass::Kernel2<x>", "kernel", 7, 20)
    assert [a[3] for a in acts] == ["kernel", "kernel", "annotation", "kernel", "sync"]
    assert device_intervals(events) == [a[:4] for a in acts[:4]]  # no synchronization record


def where_timeline():
    """Step 1: forward to 200; backward to 790, an all-reduce exposed at 400..450 between two of its kernels, the
    last bucket's exposed 602..700 inside the span (begin kernel 600..602, DDP's copies, end kernel 790..792); the
    optimizer to 900, then a collective exposed 900..930 with nothing queued after it.  Step 2: no collective."""
    ar = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    return [k(0, 1, "spin_kernel"), k(1, 200, "fwd_gemm"), k(200, 400, "bwd_gemm_a"), k(380, 450, ar),
            k(450, 600, "bwd_gemm_b"), k(590, 700, ar), k(600, 602, "bitwise_not"),
            k(700, 780, "Memcpy DtoD (Device -> Device)", "memcpy"), k(790, 792, "logical_not"),
            k(792, 900, "multi_tensor_apply_kernel"), k(900, 930, ar),
            k(1000, 1001, "spin_kernel"), k(1001, 1100, "next_gemm")]


def test_exposed_where_places_the_time_outside_the_spans_in_the_step_s_phases() -> None:
    """With phase-timer's per-step rows (device ms a phase, laid end to end from the step's marker): the exposed
    interval between two backward kernels is backward's, the one after the optimizer is cut at its end (10 us the
    optimizer's, 20 between steps: the phase at its middle names it), with the kernels either side."""
    from benchmarks.nccl_truth import exposed_where

    rows = [{"forward": 0.2, "backward": 0.59, "optimizer": 0.12, "backward.comm_wait": 0.19}, None]
    first, second = exposed_where(where_timeline(), "bitwise_not", "logical_not", phases=rows)
    assert first["inside"] == pytest.approx(0.098) and first["outside"] == pytest.approx(0.080)
    assert first["n_outside"] == 2 and first["kinds"] == {"AllReduce": pytest.approx(0.080)}
    assert first["by_phase"] == {"backward": pytest.approx(0.050), "optimizer": pytest.approx(0.010),
                                 "between": pytest.approx(0.020)}
    assert first["top"] == [(0.05, "backward", "bwd_gemm_a", "bwd_gemm_b"),
                            (0.03, "between", "multi_tensor_apply_kernel", "next_gemm")]
    assert first["longest"] == (0.05, "bwd_gemm_a", "bwd_gemm_b")
    assert first["then_idle"] == pytest.approx(0.030)  # the device idles 70 us after the second
    assert second["inside"] == second["outside"] == 0 and second["top"] == [] and second["longest"] is None
    assert second["by_phase"] == {}


def test_exposed_where_without_phase_rows_places_the_time_by_the_spans() -> None:
    """No per-step rows (or a step without them): before, among and after the step's spans; no span, no split."""
    from benchmarks.nccl_truth import exposed_where

    first, _ = exposed_where(where_timeline(), "bitwise_not", "logical_not")
    assert first["by_phase"] == {"before spans": pytest.approx(0.050), "after spans": pytest.approx(0.030)}
    assert [t[1] for t in first["top"]] == ["before spans", "after spans"]
    two_spans = where_timeline() + [k(1200, 1202, "bitwise_not"), k(1300, 1302, "logical_not"),
                                    k(1250, 1400, "ncclDevKernel_AllGather")]  # 1250..1300 inside, 1302..1400 after
    first, second = exposed_where(two_spans, "bitwise_not", "logical_not", phases=[{"forward": 0.2}])
    assert first["by_phase"] == {"before spans": pytest.approx(0.050), "after spans": pytest.approx(0.030)}
    assert second["inside"] == pytest.approx(0.050) and second["by_phase"] == {"after spans": pytest.approx(0.098)}
    no_span = [iv for iv in where_timeline() if iv[2] not in ("bitwise_not", "logical_not")]  # 600..700 exposed
    assert exposed_where(no_span, "bitwise_not", "logical_not")[0]["by_phase"] == {"no span": pytest.approx(0.180)}


def test_ddp_span_kernels_bracket_each_wait_at_the_engine_s_own_switches() -> None:
    """comm_nccl.py --span-kernels on DDP (the benchmark's wrap of a bound DdpComm, with a stand-in engine whose
    switches and the two kernels go to one log): the begin kernel right before the switch from backward to the
    wait, the end kernel right after the switch out of it (the split's own end, or backward()'s return on the usual
    path); the usual path's start (the Arm's callback, the probe's _start and _to_wait) goes through the wrap; a
    switch to the wait outside backward launches nothing."""
    from types import SimpleNamespace

    from benchmarks.comm_nccl import DdpSpanKernels
    from phase_timer.measures.comm.run import WAIT

    log = []

    class Engine:
        current = "backward"

        def switch(self, phase):
            if self.current is not None:
                log.append(phase)
                self.current = phase

        def behind(self):
            return "asked"

    engine = Engine()
    to_wait = lambda: engine.switch(WAIT)  # noqa: E731 - the probe's partial of the engine's own switch
    probe = SimpleNamespace(_engine=engine, _to_wait=to_wait, _start=to_wait, _armed=None)
    marks = DdpSpanKernels(probe, "cpu")
    marks.tiny = SimpleNamespace(bitwise_not_=lambda: log.append("begin"), logical_not_=lambda: log.append("end"))
    assert probe._engine is marks and probe._start is probe._to_wait is not to_wait
    assert probe._engine.behind() == "asked"  # everything else is the engine's
    probe._start()  # the usual path: the engine's switch to the wait, then backward() returns (to the optimizer)
    engine.switch("optimizer")
    marks.backward_returned()
    engine.current = "backward"
    probe._engine.switch(WAIT)  # a sampled backward's _split, then _joined back to backward
    probe._engine.switch("backward")
    marks.backward_returned()  # closed already: nothing
    assert log == ["begin", WAIT, "optimizer", "end", "begin", WAIT, "backward", "end"]
    engine.current = "forward"
    probe._engine.switch(WAIT)  # not from backward: no begin kernel, and the wrap counts a span without one
    assert log[-1] == WAIT and log[-2] == "end"
    assert (marks.begins, marks.ends, marks.at_return, marks.odd) == (2, 2, 1, 1)


def test_comm_nccl_leaves_the_untimed_steps_of_module_samples_out_of_its_counts():
    """With ``--modules`` a sample's step and the one after it have no row of phase-timer's (``step_ms`` None, the
    wait 0): the blocked rule's count leaves them out and the line names them, where counting them read a 30 ms gap."""
    from benchmarks.comm_nccl import blocked_line, timed, untimed_text

    def row(step: int, wait: float, blocked: float, step_ms: float | None) -> dict:
        return {"step": step, "wait": wait, "blocked": blocked, "truth": blocked, "step_ms": step_ms,
                "blocked_unmatched": 0.0, "blocked_at_call_start": blocked}

    r = {"case": "ddp_straggler", "rank": 0,
         "rows": [row(28, 16.2, 16.25, 42.5), row(29, 15.5, 15.56, 41.8), row(30, 0.0, 30.2, None),
                  row(31, 0.0, 6.7, None), row(32, 12.0, 13.0, 38.3)]}
    assert [timed(x) for x in r["rows"]] == [True, True, False, False, True]
    line = blocked_line(r)
    assert "2/3 steps within" in line and "largest gap -1.000" in line
    assert untimed_text(r) == " (2 untimed, left out: steps 30,31)"
    assert untimed_text({"rows": r["rows"][:2]}) == ""


def test_the_latency_report_reads_a_dump_s_launch_latencies_and_the_rule_with_and_without_them(tmp_path):
    """``nccl_latency.py`` on a hand-made ``--dump`` file: 20 host-paced kernels each starting 2 us after its call,
    beside a collective spinning through them (10 of them) or not (10 more after it); the blocked rule at 3 us
    counts none of their latency, at none it counts the 10 beside the collective, in 10 windows of <= 3 us."""
    import gzip
    import json

    from benchmarks import nccl_latency

    acts = [act(0, 1, 1, "spin_kernel"), act(10, 20, 2), act(20, 230, 3, NCCL, stream=COMM)]
    launches = {1: -5.0, 2: 5.0, 3: 15.0}
    for i in range(20):
        launches[10 + i] = 40.0 + 20 * i
        acts.append(act(42 + 20 * i, 47 + 20 * i, 10 + i))
    acts.append(act(2000, 2001, 51, "spin_kernel"))
    launches[51] = 1990.0
    path = tmp_path / "case_r0.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(dict(case="case", rank=0, first=7, activities=acts,
                       launches={k: [v - 4.0, v] for k, v in launches.items()},
                       rows=[[{}, {"backward.comm_wait": 0.01}], [{}, {}]]), fh)
    beside, alone = nccl_latency.latencies([tuple(a) for a in acts], launches)
    assert beside == pytest.approx([2.0] * 10)
    assert sorted(alone) == pytest.approx([2.0] * 10 + [5.0, 10.0])  # and the first kernel's, the next marker's
    row = nccl_latency.per_step([tuple(a) for a in acts], launches)[0]
    assert row["blocked"] == 0 and row["no_latency"] == pytest.approx(0.020)
    assert row["short"] == pytest.approx(0.020) and row["short_n"] == 10
    lines = nccl_latency.report(str(path))
    assert "a collective running: n=10 p10 2.00 median 2.00 p90 2.00; none: n=12" in lines[0]
    assert lines[1] == "  case rank 0: the compute stream's queued gaps by transition: none"  # every launch host-paced
    assert "case rank 0 step 7: blocked    0.000" in lines[2] and lines[2].endswith("phase-timer    0.010")
    assert "less the stream's own gaps    0.000" in lines[2]
    assert lines[-1] == ("  case rank 0: phase-timer within 0.1 ms or 2% on 1/1 steps of the blocked rule, 1/1 of it "
                         "less the stream's own gaps")


def test_the_compute_stream_s_own_gaps_beside_a_collective_come_off_the_rule_and_a_real_wait_keeps_the_rest():
    """Kernels each followed by a memcpy, all queued at 0: with no collective beside, a memcpy starts 10, 12 or 30 us
    after its kernel (median 12, mean 17.3); beside a collective, the same transition's gaps of 11 and 13 us and a
    500 us wait for the collective, and a kernel 5 us after a memset (a transition never seen alone).  Less the
    stream's own gaps, each kernel-to-memcpy gap beside the collective loses its last 12 us (the 11 us gap all of
    it): 1 us of the 13 us gap and 488 us of the wait stay, and the memset's 5 us whole.  A short kernel nested inside a longer one
    (another stream's, as the profiler may order them) does not end the gap early."""
    from benchmarks.nccl_truth import own_gap_medians, own_gaps, queued_gaps

    memcpy = "Memcpy DtoD (Device -> Device)"
    acts = [act(0, 1, 1, "spin_kernel"), act(20, 200, 2, NCCL, stream=COMM)]
    acts += [act(20, 70, 10), act(30, 40, 11), act(81, 90, 12, memcpy, "memcpy")]  # 11 us beside; 11 nested in 10
    acts += [act(90, 150, 13), act(163, 170, 14, memcpy, "memcpy")]  # 13 us beside
    acts += [act(170, 175, 18, "Memset (Device)", "memset"), act(180, 350, 15)]  # 5 us beside, never seen alone
    acts += [act(850, 860, 16, memcpy, "memcpy"), act(350, 850, 17, NCCL, stream=COMM)]  # the wait
    t = 860
    for corr, gap in zip(range(20, 26, 2), (10, 12, 30)):  # alone: each kernel right after the memcpy before it
        acts += [act(t, t + 50, corr), act(t + 50 + gap, t + 60 + gap, corr + 1, memcpy, "memcpy")]
        t += 60 + gap
    acts.append(act(2000, 2001, 5, "spin_kernel"))
    launches = {a[5]: 0.0 for a in acts} | {5: 1990.0}
    stream = compute_stream(acts)
    gaps = queued_gaps(acts, launches, stream)
    assert [(lo, hi) for lo, hi, _, beside in gaps if beside] == [(70, 81), (150, 163), (175, 180), (350, 850)]
    assert own_gap_medians(gaps) == {("kernel", "memcpy"): 12.0}  # the marker after the last memcpy: launched late
    assert own_gaps(acts, launches, stream) == [(70, 81), (151, 163), (838, 850)]
    row = per_step_blocked(acts, launches)[0]
    assert row["blocked"] == pytest.approx((11 + 13 + 5 + 500) / 1e3)
    assert row["less_own"] == pytest.approx((1 + 5 + 488) / 1e3)  # the memset's gap whole: no own time known


def test_comm_nccl_s_summary_counts_the_steps_within_the_rule_less_the_stream_s_own_gaps():
    """FSDP2's waiting rank: the rule as is 0.45 ms over phase-timer's 30 ms wait on one step (within 2%) and 0.30
    over its 5 ms on the other (out); less the stream's own gaps 0.15 and 0.05 over: both within."""
    from benchmarks.comm_nccl import blocked_line

    def row(step: int, wait: float, blocked: float, less: float) -> dict:
        return {"step": step, "wait": wait, "blocked": blocked, "truth": blocked, "step_ms": 90.0,
                "blocked_unmatched": 0.0, "blocked_at_call_start": blocked, "blocked_less_own": less}

    line = blocked_line({"case": "fsdp2", "rank": 0, "rows": [row(28, 30.0, 30.45, 30.15), row(29, 5.0, 5.3, 5.05)]})
    assert "1/2 steps within 0.1 ms or 2% of the blocked rule" in line
    assert line.endswith("less the compute stream's own gaps 17.600 (2/2 steps within 0.1 ms or 2%)")


def test_the_copies_estimate_a_b_recomputes_each_step_with_each_statistic(tmp_path):
    """``copies_estimate_ab.py`` on a hand-made ``comm_nccl.py`` output: one bucket's samples 0.10, 0.26, 0.33 ms (the
    run took the median, 0.26); a step that waited 5.0 ms by the rule, its span 5.3 before the copies came off, reads
    5.04 with the median (within), 5.2 with the lowest (out), and 5.2 as phase-timer takes it (the span exceeds the
    median by more than ``WAITED_MS``: the lowest); a step whose printed wait is not its span less the run's estimate
    (a host-paced step's own correction) is not compared."""
    from benchmarks import copies_estimate_ab

    head = ("ddp_late       rank 0: 2/2 steps within 0.1 ms or 2% of the queued rule (2/2 of the strict); copies "
            "estimate    0.260 vs profiler's own 0.1; bucket 0: queued samples [0.1, 0.26, 0.33], caught-up -")
    row = "ddp_late 0 {} {} {} 0 0 0 0 0 0 0 0 50 50 0.01 {} 0"
    text = "\n".join(["phase_timer tree abc", head, row.format(28, 5.04, 5.3, 5.0), row.format(29, 1.0, 5.3, 1.0)])
    got = copies_estimate_ab.compare(text)
    assert got == {("ddp_late", 0): {"n": 1, "median": 1, "lowest": 0, "mean": 1, "waited": 0}}
    path = tmp_path / "run.txt"
    path.write_text(text)
    lines = copies_estimate_ab.report(str(path))
    assert lines[0].endswith("phase_timer tree abc")
    assert lines[-1] == "  all: 1 steps; median 1, lowest 0, mean 1, waited 0"
    # the paced path corrected some backward of this rank: without the rows' paced column, the rank is left out
    assert copies_estimate_ab.compare(text.replace(", caught-up -", ", caught-up -; host-paced correction on 1 "
                                                   "backwards, 1.0 ms in all")) == {}
    # with it, only the corrected step is (its record holds the correction)
    flagged = "\n".join(["phase_timer tree abc", head + "; host-paced correction on 1 backwards",
                          row.format(28, 5.04, 5.3, 5.0) + " 0", row.format(30, 5.04, 5.3, 5.0) + " 1"])
    assert copies_estimate_ab.compare(flagged) == {("ddp_late", 0): {"n": 1, "median": 1, "lowest": 0, "mean": 1,
                                                                     "waited": 0}}
    # a table that prints the run's estimate for a step that waited: its steps were taken so (5.3 - 0.1 = 5.2 is as
    # run, 5.04 is not)
    waited = head.replace("0.260 vs", "0.260 (0.100 where a step waited) vs")
    text = "\n".join(["phase_timer tree abc", waited, row.format(28, 5.2, 5.3, 5.0), row.format(29, 5.04, 5.3, 5.0)])
    assert copies_estimate_ab.compare(text) == {("ddp_late", 0): {"n": 1, "median": 1, "lowest": 0, "mean": 1,
                                                                  "waited": 0}}
