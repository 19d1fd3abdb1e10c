"""INPUT_BOUND's advice follows what was measured, and followed, it helps (issue 36).

Unit layer: the rule (``phase_timer.diagnosis.input_advice``) on planted measurements -- each case of the model, and each
place where it says that no loader setting would help; the CPU readings (``phase_timer.diagnosis.cpu_use``) on planted
readings; the loader's settings read through Fabric's wrapper.

End to end, on this CPU machine: planted loaders run for real under ``phase_timer.attach``; the advice is read
back, applied (the DataLoader made again with the advised ``num_workers``), and the two runs compared, interleaved,
by their median ``period``.  A CPU-bound ``__getitem__`` and a sleeping one must get faster; a trivially cheap
dataset must not be told to use workers.  The comparison is of the two runs against each other, never against a
wall-clock figure.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import phase_timer
from phase_timer.diagnosis.cpu_use import CpuUse, Reading
from phase_timer.diagnosis import Signals, diagnose
from phase_timer.diagnosis.input_advice import HANDOVER_MS, NOTHING, Run, advise
from phase_timer.runinfo import loader_info
from phase_timer.timing.stats import RunTotals


def loader(workers: int = 0, **kw) -> dict:
    out = {"type": "DataLoader", "num_workers": workers, "pin_memory": False, "persistent_workers": False,
           "prefetch_factor": 2 if workers else None, "batch_size": 32, "iterable": False}
    out.update(kw)
    return out


def cpu(thread: tuple[float, float, float] | None = None, worker: tuple[float, float, float] | None = None,
        process: float = 1.0, workers: float | None = None, idle: float | None = None) -> dict:
    """A measured CPU summary: the training thread's and the workers' (busy, queued, asleep) shares, cores used."""
    out: dict = {"steps": 100, "wall_ms": 1000.0, "process_cores": process}
    if thread:
        out["thread"] = dict(zip(("busy", "queued", "asleep"), thread))
    if worker:
        out["worker"] = dict(zip(("busy", "queued", "asleep"), worker))
    if workers is not None:
        out["worker_cores"], out["workers_seen"] = workers, 2
    if idle is not None:
        out["idle_cores"] = idle
    return out


def advice(info: dict, period: float, wait: float, cores: int, measured: dict | None, p50: float | None = None,
           device: str = "cpu") -> tuple[list[str], dict]:
    return advise(info, Run(period, wait, wait if p50 is None else p50, cores, measured), device)


def workers_advised(tips: list[str]) -> int | None:
    """The num_workers the first tip says to try, or None."""
    import re

    m = re.search(r"try DataLoader\(num_workers=(\d+)\)", tips[0])
    return int(m.group(1)) if m else None


# -- num_workers=0 ----------------------------------------------------------------------------
def test_a_cheap_batch_keeps_num_workers_0_measured_or_not():
    """The quickstart: 0.3 ms of a 1.5 ms step to make a batch; a worker's handover costs about as much."""
    for measured in (None, cpu(thread=(1.0, 0.0, 0.0), process=1.6, idle=0.4)):
        tips, ev = advice(loader(0), 1.5, 0.3, 2, measured)
        assert tips[0].startswith("keep num_workers=0") and ev["finding"] == "cheap"
        assert workers_advised(tips) is None and "BatchSampler" in tips[1]
    assert HANDOVER_MS == 1.0


def test_a_wait_stretched_by_a_queue_for_a_core_is_costed_in_cpu_time():
    """On busy cores the 1.42 ms wait is 0.94 ms of making and the rest queued: still cheaper than a handover."""
    tips, ev = advice(loader(0), 10.0, 1.42, 2, cpu(thread=(0.66, 0.34, 0.0), process=0.7, idle=0.0))
    assert ev["finding"] == "cheap" and ev["making_ms"] == pytest.approx(1.42 * 0.66)
    assert "costs 0.94 ms to make" in tips[0] and "queued for a core" in tips[0]
    # the same wait all on a CPU is worth workers on 2 free cores
    tips, ev = advice(loader(0), 3.0, 1.42, 2, cpu(thread=(1.0, 0.0, 0.0), process=0.6, idle=1.4))
    assert ev["finding"] == "cpu" and workers_advised(tips) == 1


def test_a_sleeping_loader_gets_workers_beyond_the_cores():
    """8 ms a batch, 7.5 of it asleep: I/O; workers to deliver a batch each 2 ms step with headroom, on 2 cores."""
    tips, ev = advice(loader(0), 10.0, 8.0, 2, cpu(thread=(0.25, 0.0, 0.75), process=0.3, idle=1.7))
    assert ev["finding"] == "io" and workers_advised(tips) == 6 == ev["estimate"]["num_workers"]
    assert "slept 7.50 of the 8.00 ms" in tips[0] and "more than the 2 cores is fine" in tips[0]


def test_cpu_work_gets_the_workers_the_cores_carry():
    """4 ms of CPU a batch (5 with its handover), a 1 ms step: the period's floor is the step plus a handover."""
    tips, ev = advice(loader(0), 5.0, 4.0, 4, cpu(thread=(1.0, 0.0, 0.0), process=1.0, idle=3.0))
    assert ev["finding"] == "cpu" and workers_advised(tips) == 3  # 3 workers make a batch every 1.67 ms
    assert ev["estimate"]["period_ms"] == pytest.approx(1.0 + HANDOVER_MS)
    # on 2 cores, the process already using 1.2 of them: the floor is the CPU time (both handovers in) over 2 cores
    tips, ev = advice(loader(0), 5.0, 4.0, 2, cpu(thread=(1.0, 0.0, 0.0), process=1.2, idle=0.8))
    assert workers_advised(tips) == 2 and ev["estimate"]["period_ms"] == pytest.approx((1.2 * 5 + 2 * HANDOVER_MS) / 2)
    assert "as many as the 2 cores carry" in tips[0]


@pytest.mark.parametrize("cores, process", [(2, 1.9), (2, 1.7), (1, 1.0)])
def test_cpu_work_on_cores_this_run_keeps_busy_says_nothing_would_help(cores, process):
    """The run's own CPU time a step, spread over its cores, leaves no room: workers would take the step's CPU."""
    tips, ev = advice(loader(0), 5.0, 4.0, cores, cpu(thread=(0.9, 0.1, 0.0), process=process, idle=cores - process))
    assert tips[0].startswith(NOTHING) and ev["finding"] == "cores_busy" and "estimate" not in ev
    assert "cheaper" in tips[1] and "other processes" not in " ".join(tips)


def test_other_processes_load_is_named_not_taken_for_a_wall():
    """The scheduler shares cores by runnable thread: workers take their share from other processes too."""
    tips, ev = advice(loader(0), 5.0, 4.0, 8, cpu(thread=(0.9, 0.1, 0.0), process=1.0, idle=0.1))
    assert workers_advised(tips) == 3 and ev["other_cores"] == pytest.approx(6.9)
    assert "other processes kept 6.9 of the 8 cores busy" in tips[-1]


def test_unmeasured_cpu_says_what_it_could_not_tell():
    tips, ev = advice(loader(0), 5.0, 4.0, 16, None)
    assert ev["finding"] == "unmeasured" and "could not read the CPU time" in tips[0]
    assert "num_workers=0" in tips[0]


# -- num_workers>0 ----------------------------------------------------------------------------
def test_io_bound_workers_get_more_even_at_the_cores():
    """The issue's loader: 2 workers on 2 cores asleep in __getitem__; it never said more workers there."""
    measured = cpu(thread=(0.45, 0.0, 0.55), worker=(0.02, 0.0, 0.98), process=0.5, workers=0.02, idle=1.4)
    tips, ev = advice(loader(2), 20.0, 10.0, 2, measured)
    assert ev["finding"] == "io" and workers_advised(tips) == 6  # a worker makes a batch in 40 ms; a step is 10
    assert "more than the 2 cores is fine" in tips[0]
    assert not any("prefetch_factor" in t for t in tips)  # the wait is steady: a deeper queue would not help


def test_io_bound_workers_at_the_cap_say_the_reads_are_the_limit():
    measured = cpu(thread=(0.45, 0.0, 0.55), worker=(0.02, 0.0, 0.98), process=0.5, workers=0.1, idle=1.4)
    tips, ev = advice(loader(8), 20.0, 10.0, 2, measured)
    assert tips[0].startswith(NOTHING) and ev["finding"] == "io_capped" and "faster storage" in tips[0]


def test_a_wait_far_above_what_the_workers_spend_is_io_even_when_the_thread_is_queued():
    """On busy cores the training thread is queued, not asleep; a 10 ms wait for 0.2 ms of CPU a batch is still I/O."""
    measured = cpu(thread=(0.4, 0.5, 0.1), worker=(0.01, 0.02, 0.97), process=0.9, workers=0.01, idle=0.0)
    tips, ev = advice(loader(2), 20.0, 10.0, 2, measured)
    assert ev["finding"] == "io" and workers_advised(tips) == 6


def test_cpu_bound_workers_get_more_where_cores_are_free():
    measured = cpu(thread=(0.5, 0.0, 0.5), worker=(0.95, 0.0, 0.05), process=0.5, workers=1.9, idle=5.6)
    tips, ev = advice(loader(2), 10.0, 5.0, 8, measured)
    assert ev["finding"] == "cpu" and workers_advised(tips) == 4  # 19 ms of CPU a batch, a 5 ms step


def test_cpu_bound_workers_on_busy_cores_say_nothing_would_help():
    measured = cpu(thread=(0.5, 0.0, 0.5), worker=(0.6, 0.35, 0.05), process=0.9, workers=1.05, idle=0.05)
    tips, ev = advice(loader(2), 10.0, 5.0, 2, measured)
    assert tips[0].startswith(NOTHING) and ev["finding"] == "cores_busy"


def test_a_cheap_batch_with_workers_is_told_num_workers_0():
    """The quickstart followed: the training thread busy while it waits (receiving), the workers idle and cheap."""
    measured = cpu(thread=(0.9, 0.03, 0.07), worker=(0.05, 0.05, 0.9), process=1.3, workers=0.1, idle=0.3)
    tips, ev = advice(loader(2), 3.0, 1.0, 2, measured)
    assert ev["finding"] == "handover" and workers_advised(tips) == 0
    assert tips[0].startswith("if a batch reads nothing") and ev["if_no_reads"]  # asleep: ahead, or on reads
    # at least half their CPU is the making; the step less its share of the (this run's own) queue for a core
    assert ev["estimate"]["period_ms"] == pytest.approx(2.0 - 0.09 * 2.0 / 3.0 + 0.3 / 2)


def test_workers_asleep_near_a_batchs_cost_are_behind_only_on_uncontended_cores():
    """Workers ahead of the loop sleep too.  A 1.5 ms wait near 0.4 ms of CPU and a handover, the training thread
    asleep for it: uncontended, it waited for their next batch (I/O); queued for a core a tenth of the time, its
    sleep may be a handover's round trip held up, and reads are not told from the handover."""
    measured = cpu(thread=(0.5, 0.0, 0.5), worker=(0.05, 0.05, 0.9), process=0.5, workers=0.1, idle=1.0)
    tips, ev = advice(loader(2), 4.0, 1.5, 2, measured)
    assert ev["finding"] == "io" and workers_advised(tips) == 5  # a worker makes a batch in 8 ms; a step is 2.5
    measured = cpu(thread=(0.4, 0.1, 0.5), worker=(0.05, 0.05, 0.9), process=0.5, workers=0.1, idle=1.0)
    tips, ev = advice(loader(2), 4.0, 1.5, 2, measured)
    assert ev["finding"] == "unclear" and workers_advised(tips) is None and "try both" in tips[0]


def test_the_training_thread_queued_for_a_core_by_its_own_workers_is_told_num_workers_0():
    """The quickstart with 2 workers on 2 cores: the training thread queued for a core, the cores this run's (its
    workers and threads).  Without workers the step loses its share of that queue: then num_workers=0 gains,
    though the step as measured, the queue in it, would not show the 10%."""
    measured = cpu(thread=(0.6, 0.35, 0.05), worker=(0.3, 0.1, 0.6), process=1.5, workers=0.5, idle=0.0)
    tips, ev = advice(loader(2), 3.0, 1.0, 2, measured)  # 1.5 ms of workers' CPU a batch: 0.75 making
    assert ev["finding"] == "handover" and workers_advised(tips) == 0 and "its 2 workers held" in tips[0]
    assert tips[0].startswith("if a batch reads nothing")
    busy = {**measured, "worker": {"busy": 0.6, "queued": 0.2, "asleep": 0.2}}  # their CPU time is the making
    tips, ev = advice(loader(2), 3.0, 1.0, 2, busy)
    assert tips[0].startswith("try DataLoader(num_workers=0)") and not ev["if_no_reads"]
    assert ev["estimate"]["period_ms"] == pytest.approx(2.0 - 1.05 * 2.0 / 3.0 + 0.75)
    others = {**measured, "process_cores": 0.8}  # 0.7 of a core for other processes: the queue is theirs
    assert advice(loader(2), 3.0, 1.0, 2, others)[1]["finding"] == "cores_busy"


def test_a_handover_that_would_cost_about_as_much_in_process_says_nothing_would_help():
    """The wait is the handover, but the workers spend 3 ms of CPU a batch: made in-process, about 2 ms, no less."""
    measured = cpu(thread=(0.9, 0.02, 0.08), worker=(0.5, 0.1, 0.4), process=1.0, workers=1.0, idle=0.0)
    tips, ev = advice(loader(2), 3.0, 1.0, 2, measured)
    assert tips[0].startswith(NOTHING) and ev["finding"] == "own_work" and "about 2.00 ms" in tips[0]


def test_the_training_thread_queued_for_a_core_by_other_processes_says_nothing_would_help():
    measured = cpu(thread=(0.6, 0.35, 0.05), worker=(0.3, 0.1, 0.6), process=0.8, workers=0.5, idle=0.0)
    tips, ev = advice(loader(2), 3.0, 1.0, 2, measured)
    assert tips[0].startswith(NOTHING) and ev["finding"] == "cores_busy" and "other processes" in tips[0]
    assert ev["other_cores"] == pytest.approx(0.7)


def test_prefetch_is_advised_only_for_bursts_and_deeper_than_it_is():
    measured = cpu(thread=(0.5, 0.0, 0.5), worker=(0.1, 0.0, 0.9), process=0.5, workers=0.1, idle=7.4)
    tips, ev = advice(loader(4, prefetch_factor=3), 10.0, 2.0, 8, measured, p50=0.2)
    assert ev["finding"] == "bursts" and "prefetch_factor=6" in tips[0] and "persistent_workers=True" in tips[1]
    tips, _ = advice(loader(4, prefetch_factor=3, persistent_workers=True), 10.0, 2.0, 8, measured, p50=0.2)
    assert len(tips) == 1
    for p50 in (1.0, 2.0):  # a steady wait: no prefetch advice
        tips, _ = advice(loader(4), 10.0, 2.0, 8, measured, p50=p50)
        assert not any("prefetch" in t for t in tips), tips


def test_an_iterable_dataset_is_warned_before_more_workers():
    measured = cpu(thread=(0.25, 0.0, 0.75), process=0.3, idle=1.7)
    tips, _ = advice(loader(0, iterable=True), 10.0, 8.0, 2, measured)
    assert workers_advised(tips) == 6 and "get_worker_info" in tips[1]


def test_another_loader_is_named_and_pin_memory_only_on_cuda():
    tips, _ = advice({"type": "MyStream"}, 10.0, 8.0, 2, None)
    assert "MyStream" in tips[0] and "cannot read its settings" in tips[0]
    measured = cpu(thread=(0.25, 0.0, 0.75), process=0.3, idle=1.7)
    assert any("pin_memory" in t for t in advice(loader(0), 10.0, 8.0, 2, measured, device="cuda")[0])
    assert not any("pin_memory" in t for t in advice(loader(0), 10.0, 8.0, 2, measured)[0])


# -- the readings ---------------------------------------------------------------------------------
def reading(ms: float, *, process: float, thread: tuple[float, float], steps: int, period: float,
            workers: dict | None = None, reaped: float = 0.0, idle: float | None = None, tid: int = 1) -> Reading:
    ns = 1_000_000
    return Reading(int(ms * ns), int(process * ns), tid, (int(thread[0] * ns), int(thread[1] * ns)),
                   {pid: tuple(int(x * ns) for x in w) for pid, w in (workers or {}).items()}, int(reaped * ns),
                   None if idle is None else int(idle * ns), steps, period)


def test_the_readings_give_shares_over_the_longest_span_of_steps():
    use = CpuUse()
    use.readings = [
        reading(0, process=0, thread=(0, 0), steps=20, period=200, workers={7: (0, 0, 0), 8: (0, 0, 0)}, idle=0),
        reading(100, process=80, thread=(60, 10), steps=30, period=300, workers={7: (10, 5, 1), 8: (20, 15, 3)},
                idle=100),
        # the workers restarted (an epoch's end): 7 and 8 reaped with 40 ms of CPU in all; 9 new
        reading(200, process=160, thread=(120, 20), steps=40, period=400, workers={9: (5, 5, 0)}, reaped=40, idle=200),
        reading(300, process=240, thread=(180, 30), steps=50, period=500, workers={9: (15, 10, 1)}, reaped=40, idle=300),
        # a pause (validation, the run's end): wall time that was no step's; left out
        reading(900, process=300, thread=(200, 30), steps=60, period=600, workers={9: (16, 11, 1)}, reaped=40, idle=1500),
    ]
    s = use.summary()
    assert s["steps"] == 30 and s["wall_ms"] == 300
    assert s["process_cores"] == pytest.approx(0.8)
    assert s["thread"] == pytest.approx({"busy": 0.6, "queued": 0.1, "asleep": 0.3})
    assert s["worker_cores"] == pytest.approx((15 + 40) / 300)  # live 9's CPU and the reaped ones'
    # the workers' own split, from those seen at both ends of each pair: 7 and 8 over 100 ms, 9 over 100 ms
    assert s["worker"]["busy"] == pytest.approx((5 + 15 + 5) / 300)
    assert s["worker"]["queued"] == pytest.approx((1 + 3 + 1) / 300)
    assert s["idle_cores"] == pytest.approx(1.0)


def test_a_pause_early_in_the_run_leaves_the_span_after_it():
    use = CpuUse()
    use.readings = [reading(0, process=0, thread=(0, 0), steps=20, period=200),
                    reading(900, process=100, thread=(80, 0), steps=30, period=300),  # a validation in between
                    reading(1000, process=180, thread=(150, 10), steps=40, period=400),
                    reading(1200, process=340, thread=(290, 30), steps=60, period=600)]
    s = use.summary()
    assert s["steps"] == 30 and s["wall_ms"] == 300 and s["process_cores"] == pytest.approx(0.8)


def test_no_span_no_summary():
    use = CpuUse()
    assert use.summary() is None
    use.readings = [reading(0, process=0, thread=(0, 0), steps=20, period=200),
                    reading(100, process=80, thread=(60, 10), steps=25, period=250)]  # 5 steps: too few
    assert use.summary() is None
    use.readings[1] = reading(100, process=80, thread=(60, 10), steps=40, period=400, tid=2)  # another thread
    assert use.summary() is None


def test_the_readings_are_taken_at_a_few_windows_only():
    use = CpuUse()
    for _ in range(100):
        use.add_window(20, 200.0)
    assert [r.steps for r in use.readings] == [20 * w for w in (1, 2, 3, 4, 8, 16, 32, 64)]


def test_a_failed_reading_stops_the_readings_and_the_run_goes_on(monkeypatch):
    import phase_timer.diagnosis.cpu_use as cpu_use

    def broken(steps: int, period_ms: float) -> Reading:
        raise OSError("no /proc")

    monkeypatch.setattr(cpu_use, "read", broken)
    use = CpuUse()
    use.add_window(20, 200.0)
    use.add_window(20, 200.0)
    assert use.failed == "OSError: no /proc" and use.summary() is None


def _ended(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc")
def test_a_reading_sees_this_threads_dataloader_workers_and_reaps_nothing():
    """Its workers (named pt_data_worker by torch), not another child; a daemon process that ended is left for its
    owner to wait for, as torch's failure check of its workers does (multiprocessing.active_children would reap it)."""
    import multiprocessing
    import subprocess

    from phase_timer.diagnosis.cpu_use import read

    it = iter(DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=2, num_workers=2))
    other = subprocess.Popen(["sleep", "30"])
    ended = multiprocessing.get_context("fork").Process(target=int, daemon=True)  # after the workers: their
    ended.start()  # start() has multiprocessing reap what has ended
    while not _ended(ended.pid):
        time.sleep(0.01)
    try:
        next(it)
        r = read(10, 1.0)
        assert len(r.workers) == 2 and other.pid not in r.workers and ended.pid not in r.workers
        assert all(busy >= main > 0 for busy, main, _ in r.workers.values())
        assert os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # still waitable
    finally:
        del it
        ended.join()
        other.kill()
        other.wait()


def test_fabrics_loader_is_looked_through():
    from lightning.fabric.wrappers import _FabricDataLoader

    inner = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2, num_workers=1, persistent_workers=True)
    info = loader_info(_FabricDataLoader(inner))
    assert info["type"] == "DataLoader" and info["num_workers"] == 1 and info["persistent_workers"] is True
    assert info["wrapper"] == "_FabricDataLoader" and info["iterable"] is False
    tips, _ = advice(info, 10.0, 8.0, 2, cpu(thread=(0.25, 0.0, 0.75), worker=(0.02, 0.0, 0.98), workers=0.01))
    assert not any("_FabricDataLoader" in t for t in tips)


# -- end to end: planted loaders, the advice applied ------------------------------------------------
class CpuItems(Dataset):
    """Each item costs ``us`` µs of CPU (a spin: Python work, as decoding or augmenting is)."""

    def __init__(self, n: int, us: float) -> None:
        self.x, self.y, self.us = torch.randn(n, 16), torch.randn(n, 1), us

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = time.perf_counter() + self.us / 1e6
        while time.perf_counter() < end:
            pass
        return self.x[i], self.y[i]


class SleepyItems(CpuItems):
    """Each item waits ``us`` µs (a read from slow storage) and costs next to no CPU."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.us / 1e6)
        return self.x[i], self.y[i]


STEPS = 60


def _run(tmp_path, dataset: Dataset, batch_size: int | None, **loader_kw):
    """STEPS steps of a small regression under attach(); one epoch, so workers start once, in the warm-up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = DataLoader(dataset, batch_size=batch_size, **loader_kw)
    timer = phase_timer.attach(model, opt, data, log_dir=str(tmp_path), window=10, warmup_steps=5, summary=False)
    with timer:
        for x, y in timer.loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return timer


def _period(timer) -> float:
    return timer.totals.phases["period"].quantile(50)


#: The runs as they were must have had the cores when they wanted them: their training thread (the one busy thread
#: at num_workers=0) queued for a core less than this share of the time.  More, and other processes were taking the
#: cores, which makes a period a measure of their load, not of the advice.
QUEUED_MAX = 0.1


def _queued(timer) -> float:
    """How much of the time the run's training thread waited for a core (0 when not read)."""
    cpu = timer.diagnosis.evidence.get("cpu") or {}
    return (cpu.get("thread") or {}).get("queued", 0.0)


def _skip_if_shared(queued: list[float]) -> None:
    if max(queued) >= QUEUED_MAX:
        pytest.skip(f"the training thread waited for a core {100 * max(queued):.0f}% of the time: other processes "
                    "were taking the cores, and a period measured so says nothing of the advice")


@pytest.mark.parametrize("name, make, batch_size", [
    ("cpu", lambda: CpuItems(8 * (STEPS + 1), 1000.0), 8),  # 8 ms of CPU a batch
    ("io", lambda: SleepyItems(8 * (STEPS + 1), 1000.0), 8),  # 8 waits of 1 ms a batch
])
def test_a_costly_loader_is_advised_workers(tmp_path, name, make, batch_size):
    """CPU-heavy and waiting items: INPUT_BOUND advises a worker count.  The period it saves is a benchmark's
    (``benchmarks/input_advice.py``, ``results/input_advice_cpu.txt``): a test of it failed under load."""
    # One intra-op thread: on a 2-core machine the pool's second thread spin-waits after each step's ops and
    # keeps the other core busy (the process reads 1.9 cores in use), and the advice then rightly says the cores
    # are taken.  This test is about the loader's own cost, so the step runs on the one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _advised_workers(tmp_path, name, make, batch_size)
    finally:
        torch.set_num_threads(threads)


def _advised_workers(tmp_path, name, make, batch_size):
    first = _run(tmp_path / "first", make(), batch_size)
    d = first.diagnosis
    assert d.kind == "INPUT_BOUND", (d.kind, d.why)
    _skip_if_shared([_queued(first)])
    n = d.evidence.get("estimate", {}).get("num_workers")
    assert d.evidence["finding"] == name and n is not None and n >= 1, (d.next, d.evidence)
    assert f"try DataLoader(num_workers={n})" in d.next[0]
    advised = _run(tmp_path / "advised", make(), batch_size, num_workers=n)  # the advice as given runs
    assert advised.totals.steps == first.totals.steps


def test_a_cheap_dataset_is_not_told_to_use_workers(tmp_path):
    """The quickstart's data: a TensorDataset, 64 items a batch; the rest of the advice (a batched index) applied
    runs (the period it saves: ``benchmarks/input_advice.py``)."""
    n, bs = 64 * (STEPS + 1), 64

    def make() -> TensorDataset:
        return TensorDataset(torch.randn(n, 16), torch.randn(n, 1))

    first = _run(tmp_path / "first", make(), bs)
    d = first.diagnosis
    assert d.kind == "INPUT_BOUND", (d.kind, d.why)  # 64 items a batch for a small step: a material wait
    _skip_if_shared([_queued(first)])
    assert not any("try DataLoader(num_workers=" in t for t in d.next), d.next  # before issue 36: num_workers=2
    assert d.evidence["finding"] == "cheap" and d.next[0].startswith("keep num_workers=0"), (d.next, d.evidence)
    from torch.utils.data import BatchSampler, SequentialSampler

    data = make()
    batched = {"sampler": BatchSampler(SequentialSampler(data), bs, drop_last=False), "batch_size": None}
    advised = _run(tmp_path / "advised", data, **batched)
    assert advised.totals.steps == first.totals.steps


def test_a_cheap_dataset_with_workers_is_told_num_workers_0(tmp_path):
    """2 workers for 64 cheap items a batch (a worker's handover costs more than the items): the advice is 0 workers
    (the period it saves: ``benchmarks/input_advice.py``)."""
    n, bs = 64 * (STEPS + 1), 64
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
    first = _run(tmp_path / "first", data, bs, num_workers=2)
    d = first.diagnosis
    assert d.kind == "INPUT_BOUND", (d.kind, d.why)
    assert d.evidence["finding"] in ("handover", "own_cores") and d.evidence["estimate"]["num_workers"] == 0, d.next
    assert "try DataLoader(num_workers=0)" in d.next[0]


def test_fabrics_loader_gets_the_measured_advice_end_to_end(tmp_path):
    """Fabric's _FabricDataLoader around a sleeping loader: read through, the advice is about its num_workers."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_dataloaders(DataLoader(SleepyItems(4 * 41, 1000.0), batch_size=4))
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, wrapped, log_dir=str(tmp_path), window=10, warmup_steps=2, summary=False)
    with timer:
        for x, y in timer.loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    d = timer.diagnosis
    assert d.kind == "INPUT_BOUND" and d.evidence["loader"]["wrapper"] == "_FabricDataLoader"
    assert d.evidence["loader"]["num_workers"] == 0 and d.evidence["finding"] and "num_workers=" in d.next[0], d.next
    assert not any("_FabricDataLoader" in t for t in d.next)  # the advice names the user's loader, not the wrapper
