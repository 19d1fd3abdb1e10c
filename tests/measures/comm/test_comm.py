"""Exposed communication (``phase_timer/comm``): DDP's all-reduce wait split out of backward, on real gloo processes.

The planted collectives (``tests/dist_scripts/comm_ddp.py``) are a comm hook whose future completes a known
30 ms late: on the last bucket (nothing left to hide it) or on the first (60 ms of backward compute after it).
What a sleep guarantees is checked (the wait holds at least most of it; a hidden one holds next to none of
it), never a load-dependent upper figure beyond "not four of them".
"""

from __future__ import annotations

import json
import os

import pytest

from phase_timer.measures.comm import RunComm, hidden_share, line, split
from phase_timer.diagnosis import Signals, diagnose
from phase_timer.phases import ordered, part_of, share_base, whole_phases
from phase_timer.outputs.table import format_summary
from phase_timer.timing.stats import RunTotals
from tests.distributed.test_distributed import ROOT, SCRIPTS, _run

PLANT_MS = 30.0
WAIT = "backward.comm_wait"


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    log_dir = tmp_path_factory.mktemp("comm")
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _, result = _run([*cmd, os.path.join(SCRIPTS, "comm_ddp.py"), "--log-dir", str(log_dir)])
    for case, r in result.items():
        path = os.path.join(log_dir, case, "version_0", "phase_timer_summary.json")
        with open(path) as f:
            r["summary"] = json.load(f)
    return result


def test_a_collective_left_after_the_last_gradient_is_backward_s_exposed_wait(cases: dict) -> None:
    late = cases["late"]
    phases = late["phases"]
    assert phases[WAIT] >= 0.8 * PLANT_MS  # the 30 ms the compute waited for
    assert phases[WAIT] < phases["backward"]  # part of backward, not beside it
    comm = late["comm"]
    assert comm["collectives_ms"] >= 0.8 * PLANT_MS and comm["hidden_share"] < 0.3


def test_the_same_collective_overlapped_by_backward_s_compute_is_hidden(cases: dict) -> None:
    early = cases["early"]
    assert early["phases"][WAIT] < 0.2 * PLANT_MS  # nothing left to wait for at backward's end ...
    comm = early["comm"]
    assert comm["collectives_ms"] >= 0.8 * PLANT_MS  # ... while the collective still took its 30 ms
    assert comm["hidden_share"] > 0.7


@pytest.mark.parametrize("case", ["late", "early", "before", "average", "fp16", "no_sync"])
def test_phases_still_add_up_to_the_step_and_the_wait_is_an_of_which_row(cases: dict, case: str) -> None:
    phases = cases[case]["phases"]
    inside = [p for p in whole_phases(phases) if share_base(p) == "step" and p != "step"]
    assert WAIT in phases and WAIT not in inside
    assert sum(phases[p] for p in inside) == pytest.approx(phases["step"], rel=1e-6)
    summary = cases[case]["summary"]
    assert summary["schema_version"] == 10
    row = summary["phases"][WAIT]
    assert row["share_of"] == "step" and 0 <= row["share"] <= summary["phases"]["backward"]["share"]


def test_ddp_s_own_average_is_split_with_no_hook_and_a_builtin_hook_composes(cases: dict) -> None:
    average, fp16 = cases["average"], cases["fp16"]
    assert average["grads_ok"] and fp16["grads_ok"]  # each rank's gradient is the ranks' mean
    # no comm hook of phase-timer's without the user's: DDP's own average, nothing sampled, the wait still split
    assert average["hook_calls"] == 0 and average["comm"] is None
    block = average["summary"]["communication"]  # DDP's copies timed, no collective sampled (no hook of the user's)
    assert block["samples"] == 0 and block["collectives_ms"] is None and block["copy_samples"] == 3
    assert 0 < average["phases"][WAIT] < average["phases"]["backward"]
    assert fp16["summary"]["communication"]["hook"] == "BuiltinCommHookType.FP16_COMPRESS"
    assert fp16["comm"]["samples"] >= 8 and fp16["comm"]["collectives_ms"] > 0


def test_a_hook_registered_before_attach_is_inside_the_split_unsampled(cases: dict) -> None:
    before = cases["before"]
    assert before["phases"][WAIT] >= 0.8 * PLANT_MS  # DDP's end-of-backward waited for it: in the span
    assert before["comm"] is None and before["hook_calls"] == 27  # DDP ran it itself, every bucket


@pytest.mark.parametrize("case", ["late", "before", "average"])
def test_close_takes_the_parameter_s_hook_off(cases: dict, case: str) -> None:
    assert cases[case]["hooks_left"] == 0


def test_the_user_s_comm_hook_runs_inside_ours(cases: dict) -> None:
    late = cases["late"]
    # 14 steps (3 warm-up): the first backward has one bucket (DDP's first-bucket rule), then two a step
    assert late["hook_calls"] == 27
    assert late["summary"]["communication"]["hook"].endswith("hook")


def test_no_sync_micro_batches_have_no_communication(cases: dict) -> None:
    wait = cases["no_sync"]["phases"][WAIT]
    assert 0.8 * PLANT_MS <= wait < 2 * PLANT_MS  # one synced backward a step, not four


def test_lightning_s_ddp_strategy_is_split_with_a_comm_hook_registered_before_inside(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """Lightning's DDP strategy; a comm hook registered at on_fit_start, before the callback sees the model (where
    DDPStrategy's ddp_comm_hook goes on a GPU)."""
    from tests.distributed.test_distributed import lightning

    _, result = lightning("--root", str(tmp_path), "--strategy", "ddp", "--plant-late", str(PLANT_MS / 1e3),
                          "--steps", "12")
    phases = result["phases"]
    assert phases[WAIT] >= 0.8 * PLANT_MS and phases[WAIT] < phases["backward"]
    inside = [p for p in whole_phases(phases) if share_base(p) == "step" and p != "step"]
    assert sum(phases[p] for p in inside) == pytest.approx(phases["step"], rel=1e-6)
    assert "of which comm wait" in result["summary"]
    with open(result["summary_path"]) as f:
        summary = json.load(f)
    assert WAIT in summary["phases"] and summary["communication"]["samples"] == 0  # inside the span, not sampled


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _, result = _run([*cmd, os.path.join(SCRIPTS, "comm_fsdp.py"), "--log-dir", str(tmp_path_factory.mktemp("fsdp"))])
    return result["ranks"]


def test_fsdp2_all_gather_waiting_for_a_late_rank_is_forward_s_exposed_wait(fsdp: list[dict]) -> None:
    """Rank 1 sleeps 30 ms before its third layer: rank 0's all-gather of that layer waits for it."""
    late, on_time = fsdp[0]["phases"], fsdp[1]["phases"]
    assert late["forward.comm_wait"] >= 0.8 * PLANT_MS and late["forward.comm_wait"] < late["forward"]
    assert late["forward.comm_wait"] - on_time["forward.comm_wait"] >= 0.5 * PLANT_MS


@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp2_phases_add_up_with_both_waits_split(fsdp: list[dict], rank: int) -> None:
    phases = fsdp[rank]["phases"]
    assert 0 < phases[WAIT] < phases["backward"]  # the reduce-scatters (and re-gathers) backward waited for
    inside = [p for p in whole_phases(phases) if share_base(p) == "step" and p != "step"]
    assert "forward.comm_wait" not in inside and WAIT not in inside
    assert sum(phases[p] for p in inside) == pytest.approx(phases["step"], rel=1e-6)
    assert fsdp[rank]["restored"]  # FSDP2's functions are its own again after close()


# -- the rules, the table, the names ------------------------------------------------------


def totals_with(wait_ms: float, step_ms: float = 100.0, n: int = 30, forward_wait_ms: float | None = None) -> RunTotals:
    totals = RunTotals()
    row = {"forward": step_ms * 0.3, "backward": step_ms * 0.6, WAIT: wait_ms, "optimizer": step_ms * 0.1,
           "step": step_ms, "period": step_ms * 1.02, "data_wait": 0.5}
    if forward_wait_ms is not None:  # FSDP2's all-gathers
        row["forward.comm_wait"] = forward_wait_ms
    totals.add_window(n, {p: [v] * n for p, v in row.items()})
    return totals


def test_comm_bound_fires_at_ten_percent_of_the_step_and_names_the_fixes() -> None:
    loud = diagnose(totals_with(15.0), Signals(), clock="cuda")
    kinds = [loud.kind, *(f.kind for f in loud.secondary)]
    assert "COMM_BOUND" in kinds
    finding = loud if loud.kind == "COMM_BOUND" else next(f for f in loud.secondary if f.kind == "COMM_BOUND")
    assert finding.evidence["share_of_step"] == pytest.approx(0.15)
    assert any("bucket_cap_mb" in t for t in finding.next) and any("compress" in t for t in finding.next)
    quiet = diagnose(totals_with(5.0), Signals(), clock="cuda")
    assert "COMM_BOUND" not in [quiet.kind, *(f.kind for f in quiet.secondary)]


def test_comm_bound_sums_fsdp2_s_forward_and_backward_waits_and_names_its_fixes() -> None:
    both = diagnose(totals_with(5.0, forward_wait_ms=6.0), Signals(), clock="cuda")  # 5% + 6%: 11% together
    finding = both if both.kind == "COMM_BOUND" else next(f for f in both.secondary if f.kind == "COMM_BOUND")
    assert finding.evidence["share_of_step"] == pytest.approx(0.11)
    assert finding.evidence["parts"] == ["forward.comm_wait", WAIT]
    assert "FSDP2's all-gathers" in finding.why and any("prefetch" in t for t in finding.next)
    assert not any("bucket_cap_mb" in t for t in finding.next)
    one_device = Signals()  # FSDP2 at world size 1 gathers nothing: only backward's wait, still FSDP2's advice
    one_device.fsdp2 = True
    alone = diagnose(totals_with(15.0), one_device, clock="cuda")
    finding = alone if alone.kind == "COMM_BOUND" else next(f for f in alone.secondary if f.kind == "COMM_BOUND")
    assert any("prefetch" in t for t in finding.next)


def test_the_table_indents_the_wait_under_backward_and_counts_it_once() -> None:
    totals = totals_with(12.0)
    assert ordered(list(totals.phases))[:4] == ["data_wait", "forward", "backward", WAIT]
    assert part_of(WAIT) == "backward" and part_of("backward") is None
    table = format_summary(totals, clock="cuda")
    rows = table.splitlines()
    i = next(k for k, r in enumerate(rows) if r.startswith("backward"))
    assert rows[i + 1].startswith("  of which comm wait") and rows[i + 1].rstrip().endswith("12.0%")


def test_sampled_communication_sums_per_window_and_says_its_hidden_share() -> None:
    cols = {"comm_ms": [10.0, 20.0], "comm_wait_ms": [1.0, 2.0], "comm_samples": [1.0, 2.0], "step": [5.0]}
    got = split(cols)
    assert got == {"comm_ms": 30.0, "comm_wait_ms": 3.0, "comm_samples": 3.0} and "comm_ms" not in cols
    assert hidden_share(got) == pytest.approx(0.9)
    run = RunComm()
    run.add(got)
    assert run.as_dict()["collectives_ms"] == pytest.approx(10.0)
    assert "90% hidden" in line(run)
    assert split({"step": [1.0]}) == {} and line(RunComm()) is None


def test_the_two_gpu_script_runs_splits_and_adds_up_on_the_cpu() -> None:
    """benchmarks/comm_nccl.py (issue 40's runs, for two GPUs) in its gloo smoke mode: it stays runnable."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "benchmarks", "comm_nccl.py"), "--cpu", "--cases",
           "ddp_straggler,fsdp2,data_straggler,eval_rank0,paced200_sync"]
    _, rows = _run(cmd)
    by = {(r["case"], r["rank"]): r for r in rows}
    assert all(r["adds_up"] for r in rows) and len(rows) == 10
    # rank 1 sleeps 20 ms in forward: rank 0 waits for it in DDP's all-reduce, rank 1 does not
    assert by["ddp_straggler", 0]["backward_wait"] >= 15.0 > by["ddp_straggler", 1]["backward_wait"]
    assert all(by["fsdp2", r]["forward_wait"] is not None and by["fsdp2", r]["backward_wait"] for r in (0, 1))
    # issue 47: RANK_STRAGGLER names the slow rank (rank zero's verdict) and where it loses the time
    assert (by["ddp_straggler", 0]["straggler_rank"], by["ddp_straggler", 0]["straggler_phase"]) == (1, "forward")
    assert (by["data_straggler", 0]["straggler_rank"], by["data_straggler", 0]["straggler_phase"]) == (1, "data_wait")
    # rank 0 alone evaluates after every 6th step (untimed there): rank 1 waits for it in its next all-reduce
    ev = by["eval_rank0", 0]
    # named by the waits, or (a loaded host slowing one of its phases too) by that phase: its pauses either way
    assert ev["straggler_rank"] == 0 and ev["straggler_by"] in ("waits", "phase"), ev["findings"]
    assert ev["straggler_pauses"] >= 3 and "pauses" in ev["straggler"], ev["findings"]


def test_the_two_gpu_script_s_span_kernels_bracket_every_ddp_wait_on_the_cpu() -> None:
    """comm_nccl.py --span-kernels on a DDP case (gloo): a begin and an end kernel for each span phase-timer made, on
    the usual path (ended at backward()'s return) and on the sampled backwards (ended in the split's callback)."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "benchmarks", "comm_nccl.py"), "--cpu", "--span-kernels", "--cases", "ddp_default"]
    _, rows = _run(cmd)
    assert len(rows) == 2 and all(r["adds_up"] for r in rows)
    for r in rows:
        begins, ends, at_return, odd, waits, steps = r["span_kernels"]
        assert begins == ends == waits > 0 and odd == 0, r["span_kernels"]  # one pair a step whose row holds a wait
        assert 0 < at_return < ends, r["span_kernels"]  # both ends: the usual path's and a sampled backward's
        assert r["where"] == []  # no profiler on the CPU: no split of the exposed time
        # each step's backwards the paced path corrected (none on the host clock: the host runs the work itself)
        assert [row["paced"] for row in r["rows"]] == [0] * len(r["rows"]) and r["rows"], r["rows"]


def test_sampling_ddp_s_copies_changes_no_gradient() -> None:
    """Issue 47: the copies a sampled backward watches are DDP's copies into .grad only, made where DDP makes them;
    DDP's own copy of its used-parameter map, read at once under find_unused_parameters, runs as DDP runs it (and
    ends the timing of the copies on the rank that made it, not on the other); two
    DDP modules in one backward, a static graph, gradient_as_bucket_view: every backward sampled, every gradient
    equal to DDP's without phase-timer."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(SCRIPTS, "ddp_grads.py")]
    _, rows = _run(cmd)
    assert {r["case"] for r in rows} == {"unused", "static", "static_unused", "two", "view", "default"} and len(rows) == 12
    for r in rows:
        assert r["same"] == r["steps"], r
        if r["case"] == "view" or r["case"] == "unused" and r["rank"] == 0:  # bucket views: DDP copies nothing
            # into .grad; find_unused_parameters on the rank that skips a layer: DDP reads its used-parameter map
            # among the copies (after waiting for its all-reduce), and the copies are not timed from the first
            assert r["sampled"] == 0, r
            continue
        # (find_unused_parameters on the rank whose every parameter gets a gradient: DDP reads no map; timed)
        # the copies really were timed: all but the warm-up, the backward that counts them a bucket, and (a static
        # graph) the count again after DDP rebuilds its buckets
        assert r["sampled"] >= r["steps"] - 3, r
