"""What to try when the loop waits for its batches (INPUT_BOUND): the loader settings the run's own measurements say
would help, or that none would.

The model, per step (ms): the loop waits ``D`` (``data_wait``) of a ``period`` ``P``; the rest, ``S = P - D``, is
the step.  Where the wait goes is read from the CPU clocks (:mod:`phase_timer.diagnosis.cpu_use`): the training thread's time
asleep (waiting on a read, or on the workers' queue), on a CPU, or queued for one; the workers' CPU time and theirs
asleep; the cores this process may use (and, named beside the advice, what other processes kept busy).

- ``num_workers=0``: ``D`` is the batch's making, in the training process.  Under ``HANDOVER_MS`` a worker process
  would cost the step as much to hand the batch over as it saves: keep 0.  Asleep for at least ``IO_SHARE`` of
  ``D``, the making waits (I/O): workers overlap their waits and need no core, so the count follows the rate
  (``HEADROOM x D / S``), not the cores.  Otherwise it is CPU work, which workers run beside the step only on
  cores: the period is at least ``S + HANDOVER_MS``, at least the process's CPU time a step spread over its cores,
  and at least ``D / n``; the count is the fewest workers that reach that floor, at most one a core.
- ``num_workers>0``: the workers' CPU time a batch ``c`` (their CPU time over the span, one batch a step).  Workers
  asleep for ``IO_SHARE`` of their time and a wait of at least ``IO_RATIO x (c + HANDOVER_MS)``, which no CPU work
  explains: they wait on reads, and more of them help (the rate rule; a worker now makes a batch in
  ``num_workers x P``).  A worker ahead of the loop sleeps too, waiting for work, so asleep alone says nothing.
- ``num_workers>0`` and the training thread on a CPU (or queued for one) while it waits: the wait is its own work,
  receiving each batch (unpickling it, fetching each tensor's shared memory from the worker), or a core it waited
  for.  More workers cannot help; when making the batch in the training process (``c`` less sending it) is cheaper
  than the wait, ``num_workers=0`` -- on the condition that a batch reads nothing where the workers were mostly
  asleep (ahead of the loop, or waiting on reads: their CPU time is all of the making only in the first case).
- ``num_workers>0``, the training thread asleep while it waits, the workers busy: they are behind on CPU; more only
  if the cores have room (the same floor, with ``c``).  The workers asleep too but the wait near ``c`` plus a
  handover: reads or the handover, not told apart; it says so.
- Advice that the model does not expect to shorten ``period`` by ``MIN_GAIN`` is not given: it says that no
  loader setting is likely to help, and why.  A deeper prefetch only where the wait comes in bursts (its median
  at most ``BURSTY`` of its mean: slow batches now and then, which a longer queue absorbs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: What receiving one batch from a worker process costs the training process (ms): unpickling it, and for each
#: tensor a file descriptor fetched from the worker and its shared memory mapped.  Measured on the 2-core VM the
#: README's quickstart runs on: 1.07 ms of the training thread's CPU a batch of two tensors, against 0.69 ms to
#: make that batch in-process (``docs/diagnosis.md``).  At ``num_workers=0`` a batch made in less than this is not
#: worth a worker; with workers, the step pays it, so the period's floor is ``S + HANDOVER_MS``.
HANDOVER_MS = 1.0
#: The training thread (or the workers) asleep for at least this share of the wait: the loading waits, not computes.
IO_SHARE = 0.5
#: With workers, asleep is not enough (a worker is asleep too when it is ahead, waiting for work): the wait must
#: also be at least this many times what a batch costs the workers in CPU plus its handover, which no CPU work
#: explains.  It holds when the cores are busy too, where the training thread is queued rather than asleep.
IO_RATIO = 2.0
#: The training thread queued for a core at least this share of the period: the cores are contended.
CONTENDED = 0.1
#: Workers for a waiting (I/O) loader: enough to deliver a batch every step with this much to spare ...
HEADROOM = 1.5
#: ... and at most this many per core (each holds a copy of the dataset object and its prefetched batches).
IO_WORKERS_PER_CORE = 4
MIN_IO_CAP = 8
#: Advice only where the model expects ``period`` shorter by at least this share.
MIN_GAIN = 0.1
#: The wait comes in bursts when its median is at most this share of its mean.
BURSTY = 0.25

#: Other processes' load named beside the advice from this many cores.
OTHERS_CORES = 0.5

NOTHING = "no loader setting is likely to help: "


@dataclass(frozen=True)
class Run:
    """What the advice reads: the run's means (ms), the cores, and the CPU shares (``CpuUse.summary()``)."""

    period: float
    wait: float
    wait_p50: float
    cores: int | None
    cpu: dict[str, Any] | None

    @property
    def step(self) -> float:
        return max(self.period - self.wait, 0.05)

    def thread(self, what: str) -> float | None:
        """The training thread's ``busy``/``queued``/``asleep`` time a step (ms), or None when not read."""
        t = (self.cpu or {}).get("thread")
        return t[what] * self.period if t else None

    def worker(self, what: str) -> float | None:
        """The workers' share of their time ``busy``/``queued``/``asleep``, or None when not read."""
        w = (self.cpu or {}).get("worker")
        return w[what] if w else None

    def making_cpu(self) -> float:
        """At ``num_workers=0``: the batch's making in CPU time (ms), the wait less the training thread's sleep and
        its share queued for a core (spread evenly over the step); the wait itself when the thread is unread."""
        t = (self.cpu or {}).get("thread")
        if not t:
            return self.wait
        awake = max(0.0, self.wait - t["asleep"] * self.period)
        return awake * t["busy"] / (t["busy"] + t["queued"]) if t["busy"] + t["queued"] > 0 else awake

    def others(self) -> float | None:
        """Cores other processes kept busy: the machine's cores less its idle time and this run's CPU (None: unread)."""
        cpu = self.cpu or {}
        if self.cores is None or cpu.get("idle_cores") is None:
            return None
        return max(0.0, self.cores - cpu["idle_cores"] - cpu["process_cores"] - cpu.get("worker_cores", 0.0))

    def gains(self, predicted: float) -> bool:
        return predicted <= (1 - MIN_GAIN) * self.period


def advise(loader: dict[str, Any] | None, run: Run, device_type: str | None) -> tuple[list[str], dict[str, Any]]:
    """What to try (most likely first) and the evidence it rests on (``finding``: which case, ``estimate``)."""
    if not loader:
        return ["the loader's settings are unknown here: more DataLoader workers, pinned memory, persistent "
                "workers"], {}
    if loader.get("type") != "DataLoader":
        return [f"the loader is a {loader.get('type')}, neither a DataLoader nor a wrapper of one: its own parallel "
                "reading and prefetching (phase-timer cannot read its settings)"], {}
    workers = loader.get("num_workers") or 0
    if workers and run.wait_p50 <= BURSTY * run.wait:  # most steps wait little: the workers keep up on average
        tips, ev = _bursts(loader, run), {"finding": "bursts"}
    else:
        tips, ev = (_in_process(loader, run) if workers == 0 else _with_workers(loader, run, workers))
    if ev.get("estimate", {}).get("num_workers", 0) > workers and loader.get("iterable"):
        tips.insert(1, "the dataset is an IterableDataset: every worker iterates its own copy, so it must split its "
                    "data by torch.utils.data.get_worker_info() or the batches repeat")
    if loader.get("pin_memory") is False and device_type == "cuda":
        tips.append("pin_memory=False: pinned batches copy faster and without blocking")
    others = run.others()
    if others is not None and others >= OTHERS_CORES:
        ev["other_cores"] = others
        tips.append(f"other processes kept {others:.1f} of the {run.cores} cores busy during the run: its figures, "
                    "and this advice, hold for that load")
    return tips, ev


def _in_process(loader: dict[str, Any], run: Run) -> tuple[list[str], dict[str, Any]]:
    """``num_workers=0``: the wait is the batch's making, in the training process."""
    d, asleep = run.wait, run.thread("asleep")
    io = asleep is not None and asleep >= IO_SHARE * d
    cost = run.making_cpu()
    if d < HANDOVER_MS or (not io and cost < HANDOVER_MS):
        bs = loader.get("batch_size") or "B"
        queued = f" (of its {d:.2f} ms wait; the rest it slept or was queued for a core)" if cost < d - 0.05 else ""
        return [f"keep num_workers=0: a batch costs {cost:.2f} ms to make in the training process{queued}, less than "
                f"a worker process costs it to hand one over (~{HANDOVER_MS:g} ms): workers would slow the step",
                f"what is left is the per-item path ({bs} __getitem__ calls and a collate a batch): index the whole "
                f"batch at once, DataLoader(dataset, sampler=BatchSampler(RandomSampler(dataset), {bs}, "
                "drop_last=False), batch_size=None), where dataset[list of indices] returns the batch (a "
                "TensorDataset's does)"], {"finding": "cheap", "making_ms": cost}
    if io:
        n = _io_workers(d, run)
        return [f"num_workers=0 and the loading waits: the training thread slept {min(asleep, d):.2f} of the {d:.2f} "
                f"ms a step it waited for a batch (I/O, not CPU); try DataLoader(num_workers={n}){_beyond(n, run)}"], \
            {"finding": "io", "estimate": {"num_workers": n}}
    if run.cpu is None:
        return [_unmeasured(f"num_workers=0 and a batch takes {d:.2f} ms to make in the training process: workers "
                            f"make batches beside the step; try DataLoader(num_workers={min(2, run.cores or 2)})")], \
            {"finding": "unmeasured"}
    return _cpu_workers(run, 0, cost, run.cpu["process_cores"], f"num_workers=0 and making a batch is CPU work "
                                                                f"({cost:.2f} ms a step in the training process)")


def _with_workers(loader: dict[str, Any], run: Run, workers: int) -> tuple[list[str], dict[str, Any]]:
    """``num_workers>0``: are the workers behind (waiting on reads, or on CPU), or is the wait the handover?"""
    d, asleep = run.wait, run.thread("asleep")
    if asleep is None or "worker_cores" not in (run.cpu or {}):
        return [_unmeasured(f"the {workers} workers do not keep up: more workers if the loading waits on reads or "
                            "the cores have room; num_workers=0 if a batch is cheap to make")], \
            {"finding": "unmeasured"}
    per_batch = run.cpu["worker_cores"] * run.period  # the workers' CPU time a batch (one batch a step)
    w_asleep = run.worker("asleep") or 0.0
    # The training thread asleep while it waits: for the workers' next batch, or, where the cores are contended, for
    # a worker thread queued behind others (each tensor's memory is fetched from the worker).  Only uncontended
    # does its sleep alone say the workers are behind; contended, the wait must be more than a batch's cost.
    contended = (run.thread("queued") or 0.0) >= CONTENDED * run.period
    behind = asleep >= IO_SHARE * d and not contended
    if w_asleep >= IO_SHARE and (behind or d >= IO_RATIO * (per_batch + HANDOVER_MS)):
        return _io_more(run, workers, w_asleep, asleep, per_batch)
    if asleep < IO_SHARE * d:  # the training thread on a CPU (or queued for one) while it waited
        return _own_work(run, workers, per_batch, asleep, w_asleep)
    if w_asleep < IO_SHARE:  # it slept while the workers computed: they are behind, on CPU
        used = run.cpu["process_cores"] + run.cpu["worker_cores"]
        return _cpu_workers(run, workers, per_batch, used, f"the {workers} workers are CPU-bound "
                            f"({per_batch:.2f} ms of CPU a batch, busy or queued for a core "
                            f"{100 * (1 - w_asleep):.0f}% of their time)")
    # Both asleep on contended cores, the wait near what a batch costs: workers waiting on reads, or for work (then
    # the wait is the handover, its round trips held up by a queue for a core).  Not told apart here.
    queued = run.thread("queued") or 0.0
    return [f"the {workers} workers were asleep {100 * w_asleep:.0f}% of their time and spend {per_batch:.2f} ms of "
            f"CPU a batch, and the training thread waited {queued:.2f} ms a step for a core: on contended cores a "
            f"wait of {d:.2f} ms a step does not tell whether they wait on reads (then more workers help) or for work "
            "(then the wait is the handover, and num_workers=0 is faster): try both"], {"finding": "unclear"}


def _own_work(run: Run, workers: int, per_batch: float, asleep: float,
              w_asleep: float) -> tuple[list[str], dict[str, Any]]:
    """The training thread was on a CPU or queued for one while it waited: the wait is its own, not the workers'."""
    d, queued = run.wait, run.thread("queued") or 0.0
    spent = f"the training thread slept only {asleep:.2f} of the {d:.2f} ms a step it waited"
    # In the training process the batch would cost what the workers spend on it less sending it (its pickling and
    # shared memory, ~a handover), and at least half of what they spend.
    making = max(per_batch - HANDOVER_MS, per_batch / 2)
    # Where the cores were this run's, the training thread's queue for one is its own workers' doing: without them
    # the step loses its share of that queue (the queue spread evenly over the period).
    others = run.others()
    own = others is not None and others < OTHERS_CORES
    step = run.step - (queued * run.step / run.period if own else 0.0)
    if making < d and run.gains(step + making):
        held = (f"; and it waited {queued:.2f} ms a step for a core, which the cores being this run's, its {workers} "
                "workers held" if own and queued >= 0.1 * d else "")
        # Workers mostly asleep are ahead of the loop, or wait on reads within each batch: their CPU time is the
        # whole of a batch's making only in the first case, which the user can tell and this cannot.
        reads = w_asleep >= IO_SHARE
        when = (f"if a batch reads nothing (its data in memory: the workers were asleep {100 * w_asleep:.0f}% of "
                "their time, waiting for work or on reads), " if reads else "")
        return [f"{when}try DataLoader(num_workers=0): the wait is the training process's own work ({spent}): "
                f"receiving a batch from a worker costs it more than making one would (the workers spend "
                f"{per_batch:.2f} ms of CPU a batch, sending it included){held}"], \
            {"finding": "handover", "if_no_reads": reads, "estimate": {"num_workers": 0, "period_ms": step + making}}
    if queued >= IO_SHARE * d:  # it waited for a core, and not (only) for its workers
        return [NOTHING + f"the training thread waited {queued:.2f} ms a step for a core ({spent}): the cores are "
                "busy with other processes; fewer threads or processes beside the training leave it its cores"], \
            {"finding": "cores_busy"}
    return [NOTHING + f"the wait is the training process's own work, receiving each batch from the workers ({spent}); "
            f"making it there instead would cost about {making:.2f} ms (the workers' {per_batch:.2f} ms of CPU a batch "
            "less sending it), not clearly less: fewer, larger tensors a batch cost less to hand over"], \
        {"finding": "own_work"}


def _cpu_workers(run: Run, workers: int, making: float, used: float, what: str) -> tuple[list[str], dict[str, Any]]:
    """CPU-bound making of ``making`` ms a batch: the fewest workers that reach the period's floor, if it gains."""
    # The cores are this run's affinity: other processes' load is no wall (the scheduler shares the cores by
    # runnable thread, so workers take their share from them too); advise() names that load.
    p, cores = run.period, float(run.cores or 1)
    # From num_workers=0, each batch also costs a handover: the training process receives it, the worker sends it
    # (its pickling and shared memory, taken as much again).  With workers, both are paid already.
    handover = HANDOVER_MS if workers == 0 else 0.0
    making += handover
    floor = max(run.step + handover, (used * p + 2 * handover) / cores)
    n = max(1, math.ceil(making / floor - 1e-9))
    n = min(n, max(1, math.floor(cores + 1e-9)))
    predicted = max(floor, making / n)
    ev: dict[str, Any] = {"finding": "cpu", "floor_ms": floor}
    if n > workers and run.gains(predicted):
        ev["estimate"] = {"num_workers": n, "period_ms": predicted}
        return [f"{what}; try DataLoader(num_workers={n}): workers make batches beside the step, as many as the "
                f"{run.cores} cores carry (an estimate: period {p:.2f} -> ~{predicted:.2f} ms)"], ev
    ev["finding"] = "cores_busy"
    return [NOTHING + f"{what} and this run keeps the cores busy ({used * p:.2f} ms of CPU a step on {run.cores} "
            f"core(s), {used:.1f} in use): more workers would take their CPU from the step",
            "make a batch cheaper (decode or augment less on the CPU, a faster format, augment on the GPU), or run "
            "on more cores"], ev


def _io_more(run: Run, workers: int, w_asleep: float, asleep: float,
             per_batch: float) -> tuple[list[str], dict[str, Any]]:
    """Workers behind and asleep: they wait on reads; more of them overlap more waits, beyond the cores."""
    n = _io_workers(workers * run.period, run)  # each worker makes a batch every ``workers`` periods
    said = (f"the {workers} workers wait on I/O: asleep {100 * w_asleep:.0f}% of their time and {per_batch:.2f} ms "
            f"of CPU a batch, while the training thread slept {min(asleep, run.wait):.2f} of the {run.wait:.2f} ms a "
            "step it waited for them")
    if n <= workers:
        return [NOTHING + f"{said}, and {workers} workers is already the cap this rule sets "
                f"({_io_cap(run)} on {run.cores} cores); the reads are the limit: faster storage, a local copy, "
                "fewer and larger files"], {"finding": "io_capped"}
    return [f"{said}; try DataLoader(num_workers={n}){_beyond(n, run)}"], \
        {"finding": "io", "estimate": {"num_workers": n}}


def _beyond(n: int, run: Run) -> str:
    if run.cores is None or n <= run.cores:
        return ""
    return (f": a waiting worker needs no core, so more than the {run.cores} cores is fine (torch warns of it; "
            "that warning is about workers that compute)")


def _io_workers(making: float, run: Run) -> int:
    """Workers that each make a batch in ``making`` ms and together deliver one every step, with headroom."""
    return max(2, min(_io_cap(run), math.ceil(HEADROOM * making / run.step)))


def _io_cap(run: Run) -> int:
    return max(MIN_IO_CAP, IO_WORKERS_PER_CORE * (run.cores or 1))


def _bursts(loader: dict[str, Any], run: Run) -> list[str]:
    pf = loader.get("prefetch_factor") or 2
    tips = [f"the wait comes in bursts (median {run.wait_p50:.2f} ms a step, mean {run.wait:.2f}): a deeper prefetch "
            f"absorbs slow batches: prefetch_factor={2 * pf}"]
    if not loader.get("persistent_workers"):
        tips.append("persistent_workers=True: the workers restart every epoch, and each restart is a burst")
    return tips


def _unmeasured(tip: str) -> str:
    return (tip + " (phase-timer could not read the CPU time here, so it cannot tell CPU work, which workers "
            "speed up only as far as the free cores, from waiting, which more workers overlap)")
