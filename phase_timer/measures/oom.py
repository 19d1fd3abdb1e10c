"""An out-of-memory crash, explained: where the run was, what failed, what each phase held; the snapshot.

When ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class) passes through a
door, the door calls :func:`caught` once, before it closes the run, and the exception goes on to the
user unchanged (nothing here raises).  ``caught`` notes on the run's :class:`OutOfMemory` measure what was known
at that moment (the summary file's ``oom``; ``TimingCore.oom`` reads it): the step and the phase the boundaries were in, the size
that failed and the allocator's own figures (from its message), the allocator's counters and the
device's free memory read at the door, what the last memory step saw each phase hold, and the sizes
of the weights, their gradients and the optimizer's state.  The measure hands it to the verdict, which then
leads with ``OUT_OF_MEMORY`` (:func:`phase_timer.diagnosis.out_of_memory`).  A core made without the measure
notes nothing (its summary's ``oom`` is null).

Nothing here waits for the device.  The counters are the caching allocator's host-side statistics
(``torch._C._cuda_memoryStats``); the device's free memory is ``cudaMemGetInfo``, a driver query that
waits for no stream (``docs/faults.md``: what is known of a stuck device).  The frames the error passed
through are still alive (its traceback holds them), so what their tensors hold is still allocated.

``memory_snapshot=`` (opt-in): the allocator records its history (``measures/snapshot.py``'s ``Snapshot``, a measure
of its own filling the summary's ``memory_snapshot``: bounded entries, Python stacks only) from the run's start; a
snapshot is dumped on an out-of-memory error, and at the run's end when asked (``"end"``), for PyTorch's memory
visualizer (https://pytorch.org/memory_viz).

Under torch.distributed the rank that ran out writes its own summary file
(``phase_timer_summary.rank<r>.json``, beside rank zero's) and appends its finding to one key of the
job's store; rank zero's measure reads that key at the run's end (:meth:`OutOfMemory.end`), whatever ended it.  Every store request is made on
a thread joined at most :data:`STORE_WAIT_S`: no rank ever waits on another here (one stuck in a
collective never answers), only on the store, and not for long.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from phase_timer.measure import Measure
from phase_timer.measures import memory as _memory
from phase_timer._env import warn

log = logging.getLogger(__name__)

MB = float(1 << 20)
#: The key of ``memory_snapshot=``'s measure (:class:`phase_timer.measures.snapshot.Snapshot`, which imports this
#: module's rank files): the error's facts name its dump.
SNAPSHOT_KEY = "memory_snapshot"
#: The longest a store request on an error's path is waited for (its thread is left behind after that).
STORE_WAIT_S = 2.0
#: How much of the error's message the summary keeps.
MESSAGE_CHARS = 600

_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"
_UNIT_MB = {"bytes": 1 / MB, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "TiB": 1024.0 * 1024}
#: What the CUDA caching allocator's message says (c10's ``format_size``: bytes, KiB, MiB, GiB), at the failure.
_REPORTED = (
    ("total_mb", rf"total capacity of {_SIZE}"),
    ("free_mb", rf"of which {_SIZE} is free"),
    ("process_mb", rf"this process has {_SIZE} memory in use"),
    ("allocated_mb", rf"{_SIZE} is allocated by PyTorch"),
    ("reserved_unallocated_mb", rf"{_SIZE} is reserved by PyTorch but unallocated"),
)


# -- the error ------------------------------------------------------------------------
def find(exc: BaseException | None) -> BaseException | None:
    """The out-of-memory error ``exc`` is, or was raised from (``raise ... from``); None if neither."""
    import torch

    kind = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    for _ in range(8):
        if exc is None or isinstance(exc, kind):
            return exc
        exc = exc.__cause__
    return None


def parse_message(text: str) -> dict[str, Any]:
    """The sizes an out-of-memory message states (MB), and the device it names: ``requested_mb`` (the
    allocation that failed) and, from the CUDA allocator's own message, its figures at the failure."""
    out: dict[str, Any] = {}
    m = re.search(rf"Tried to allocate {_SIZE}", text)
    out["requested_mb"] = float(m.group(1)) * _UNIT_MB[m.group(2)] if m else None
    for key, pattern in _REPORTED:
        m = re.search(pattern, text)
        if m:
            out[key] = float(m.group(1)) * _UNIT_MB[m.group(2)]
    m = re.search(r"GPU (\d+) has a total capacity", text)
    if m:
        out["device"] = int(m.group(1))
    return out


# -- where the run was -----------------------------------------------------------------
@dataclass(frozen=True)
class Cut:
    """Where the boundaries were when the plain door's loader was closed (an exception in the loop closes it,
    and its close moves the boundaries on before the door's ``__exit__`` hears of the exception), and the
    frames that closed it: ``(id, code, instruction)`` from the innermost outwards."""

    phase: str
    step: int | None
    in_step: bool
    begun: int
    frames: tuple[tuple[int, Any, int], ...]


def cut(bounds: Any, frame: Any) -> Cut:
    """``bounds`` now, and ``frame`` (the one that closed the loader) with its callers, for :func:`caught`."""
    frames = []
    while frame is not None and len(frames) < 8:
        frames.append((id(frame), frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return Cut(*where(bounds), bounds.begun, tuple(frames))


def _closed_by(c: Cut, exc: BaseException) -> bool:
    """Did ``exc`` close the loader?  The innermost frame that closed it which ``exc`` passed through was then at
    the very instruction ``exc`` passed it at.  A ``break`` (then an error later), or an error that passed
    elsewhere, meet that frame at another instruction or not at all."""
    passed: dict[int, tuple[Any, int]] = {}
    tb = exc.__traceback__
    while tb is not None:
        passed[id(tb.tb_frame)] = (tb.tb_frame.f_code, tb.tb_lasti)
        tb = tb.tb_next
    for fid, code, lasti in c.frames:
        entry = passed.get(fid)
        if entry is not None and entry[0] is code:
            return entry[1] == lasti
    return False


def where(bounds: Any) -> tuple[str, int | None, bool]:
    """(the phase the boundaries say runs now, the door's index of the last step begun, whether it is open).

    A ``backward()`` that raised has moved the boundaries on to the optimizer's provisional time: that is
    backward's failure."""
    phase = bounds.now()
    if bounds.open and not bounds.paused and not bounds._explicit and bounds._failed and bounds._after_backward:
        phase = "backward"
    return phase, (bounds._step if bounds.begun else None), bool(bounds.open)


# -- what was held ------------------------------------------------------------------------
def _allocator(core: Any) -> dict[str, Any] | None:
    """The allocator's counters and the device's memory now (None off CUDA): the tracker's reader, else one made
    for the clock's device (``memory=False``).  Host counters and ``cudaMemGetInfo``: no wait for the device."""
    tracker = _memory.tracker_of(core.measures)
    if tracker is not None:
        reading, info = tracker.now()
    else:
        found = _memory.reader_for(core.clock)
        if found is None:
            return None
        read, device_info = found
        reading = read()
        try:
            info = device_info()
        except Exception:  # noqa: BLE001 - a driver that cannot say: the counters still tell
            info = None
    out: dict[str, Any] = {"allocated_mb": reading.allocated / MB, "reserved_mb": reading.reserved / MB,
                           "peak_allocated_mb": reading.peak_allocated / MB,
                           "peak_reserved_mb": reading.peak_reserved / MB, "device_free_mb": None, "device_total_mb": None}
    if info is not None:
        out["device_free_mb"], out["device_total_mb"] = info[0] / MB, info[1] / MB
    return out


def _phase_peaks(reads: list[tuple[str, Any]]) -> dict[str, float]:
    """In one memory step's reads: each phase across which the allocator's peak rose, and the peak it reached (MB).
    A phase whose peak stayed under the run's earlier one (the first optimizer step's) is absent: not known."""
    peaks: dict[str, float] = {}
    if not reads:
        return peaks
    top = reads[0][1].peak_allocated
    for (phase, _), (_, after) in zip(reads, reads[1:]):
        if after.peak_allocated > top:
            top = after.peak_allocated
            peaks[phase] = top / MB
    return peaks


def _held(tracker: Any) -> dict[str, Any] | None:
    """What the last memory step saw (MB at each boundary, activations, the peaks its phases reached), and the
    failing step's own reads so far when it was a memory step; None where memory is not read."""
    if tracker is None:
        return None
    out: dict[str, Any] = {"last_step": None, "last_mb": None, "phase_peaks_mb": {}, "this_step": None}
    if tracker.last is not None:
        step, values, reads = tracker.last
        out.update(last_step=step, last_mb=dict(values), phase_peaks_mb=_phase_peaks(reads))
    step, reads = tracker.reads_so_far()
    if reads:
        out["this_step"] = {"step": step, "reads_mb": [[phase, r.allocated / MB] for phase, r in reads]}
    return out


def _nbytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): this rank's shard
    return local.numel() * local.element_size()


def _state_sizes(optimizers: Iterable[Any], device_type: str) -> dict[str, float] | None:
    """The weights the optimizers step, their gradients and the optimizers' state (MB) on the run's device type:
    host-side metadata (shapes and dtypes), no device access."""
    import torch

    params: dict[int, Any] = {}
    state: dict[int, Any] = {}
    for opt in optimizers:
        inner = [opt, getattr(opt, "optimizer", None), getattr(opt, "base_optimizer", None)]  # accelerate's, SAM's
        for o in inner:
            if not isinstance(o, torch.optim.Optimizer):
                continue
            for group in o.param_groups:
                for p in group["params"]:
                    params[id(p)] = p
            for per_param in o.state.values():
                for v in per_param.values() if isinstance(per_param, dict) else ():
                    if isinstance(v, torch.Tensor) and v.device.type == device_type:
                        state[id(v)] = v
    if not params:
        return None
    on = [p for p in params.values() if p.device.type == device_type]
    return {"weights_mb": sum(_nbytes(p) for p in on) / MB,
            "gradients_mb": sum(_nbytes(p.grad) for p in on if p.grad is not None) / MB,
            "optimizer_state_mb": sum(_nbytes(v) for v in state.values()) / MB}


# -- the doors call this ----------------------------------------------------------------
def caught(exc: BaseException | None, core: Any, bounds: Any, *, optimizers: Iterable[Any] = (),
           cut: Cut | None = None) -> None:
    """An exception passed through a door: if it is (or was raised from) an out-of-memory error, note what was
    known on ``core``'s :class:`OutOfMemory` measure (once; a core without one notes nothing), dump the snapshot if
    one is recorded, and under torch.distributed tell rank zero.  ``cut``: the plain door's :class:`Cut`, used when
    ``exc`` is what closed its loader.  Never raises."""
    measure = core.measure(OutOfMemory.key) if core is not None else None
    if not isinstance(measure, OutOfMemory) or measure.facts is not None:
        return
    try:
        error = find(exc)
        if error is None:
            return
        measure.facts = facts = _facts(exc, error, core, bounds, optimizers, cut)
        snapshot = core.measure(SNAPSHOT_KEY)  # measures/snapshot.py's Snapshot, where memory_snapshot= asked
        if snapshot is not None:
            facts["snapshot"] = snapshot.dump("oom")
        if core.ranks is not None and core.ranks.rank != 0:
            _from_this_rank(core, facts)
    except Exception as err:  # noqa: BLE001 - the user's exception goes on whatever happens here
        warn(log, f"phase-timer: could not explain the out-of-memory error ({type(err).__name__}: {err})")


def _facts(exc: BaseException, error: BaseException, core: Any, bounds: Any, optimizers: Iterable[Any],
           c: Cut | None) -> dict[str, Any]:
    if bounds is not None:
        if c is not None and c.begun == bounds.begun and (_closed_by(c, error) or _closed_by(c, exc)):
            phase, step, in_step = c.phase, c.step, c.in_step
        else:
            phase, step, in_step = where(bounds)
        begun = bounds.begun
    else:  # the run closed before the error came through: nothing known of where
        phase, step, in_step, begun = None, None, False, core.steps_begun
    text = str(error)
    reported = parse_message(text)
    try:
        allocator = _allocator(core)
    except Exception as err:  # noqa: BLE001 - the figures from the message still tell
        allocator = {"error": f"{type(err).__name__}: {err}"}
    return {
        "rank": core.ranks.rank if core.ranks is not None else None,
        "step": step, "in_step": in_step, "phase": phase, "steps_begun": begun,
        "warmup": begun <= core.warmup_steps,
        "exception": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": text[:MESSAGE_CHARS],
        "requested_mb": reported.pop("requested_mb"),
        "reported": reported or None,
        "allocator": allocator,
        "held": _held(_memory.tracker_of(core.measures)),
        "state_mb": _state_sizes(optimizers, core.context.get("device_type", "cpu")),
        "snapshot": None,
    }


def own(core: Any) -> bool:
    """This rank's run ended in its own out-of-memory error (so it prints its table, as rank zero does)."""
    measure = core.measure(OutOfMemory.key)
    return isinstance(measure, OutOfMemory) and measure.own()


def _end_failed(err: Exception) -> None:
    warn(log, f"phase-timer: the end of the out-of-memory watch failed ({type(err).__name__}: {err})")


class OutOfMemory(Measure):
    """The out-of-memory error that ended the run, as a measure: what :func:`caught` noted (:attr:`facts`), for the
    summary file (``oom``: null where none did) and the verdict's rules (``diagnose(oom=...)``).

    The doors call :func:`caught` (nothing here runs on a step).  At the run's end, rank zero under
    torch.distributed reads what the other ranks reported through the job's store (:meth:`end`)."""

    key = "oom"

    def __init__(self, ranks: Any = None) -> None:
        self.ranks = ranks
        #: What was known when an out-of-memory error ended the run (None: none did).
        self.facts: dict[str, Any] | None = None

    def own(self) -> bool:
        """This rank's run ended in its own out-of-memory error (not one another rank reported)."""
        facts = self.facts
        return facts is not None and facts.get("rank") == (self.ranks.rank if self.ranks is not None else None)

    def end(self, totals: Any) -> list[str]:
        """The run's end, whatever ended it: rank zero under torch.distributed reads what the other ranks reported.
        Never raises."""
        try:
            if self.ranks is not None and self.ranks.rank == 0:
                self._from_other_ranks()
        except Exception as err:  # noqa: BLE001 - the run's numbers are written whatever happens here
            _end_failed(err)
        return []

    def verdict(self) -> dict[str, Any]:
        return {"oom": self.facts}

    def summary(self) -> dict[str, Any] | None:
        return self.facts

    def _from_other_ranks(self) -> None:
        """Rank zero: the findings the other ranks appended.  Its own finding stays first; without one, the lowest
        rank's leads.  ``ranks_out_of_memory`` names every rank that reported one."""
        store, key = self.ranks.store, _key(self.ranks, "oom")
        text = _bounded(lambda: store.get(key) if store.check([key]) else None)
        if not text:
            return
        reports = []
        for line in bytes(text).decode(errors="replace").splitlines():
            try:
                reports.append(json.loads(line))
            except ValueError:
                continue  # a line still being appended
        reports = sorted((r for r in reports if isinstance(r, dict) and isinstance(r.get("rank"), int)),
                         key=lambda r: r["rank"])
        if not reports:
            return
        if self.facts is None:
            self.facts = reports[0]
        self.facts["ranks_out_of_memory"] = sorted({r["rank"] for r in reports} | ({0} if self.own() else set()))


def _ranked(path: str, rank: int) -> str:
    """``path`` for ``rank``: rank zero's as given, another's with ``.rank<r>`` before the suffix."""
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def rank_file_name(rank: int) -> str:
    """The summary file of a rank other than zero that ran out of memory, beside rank zero's."""
    return f"phase_timer_summary.rank{rank}.json"


# -- between ranks: the job's store, never another rank ---------------------------------------
def _key(ranks: Any, what: str) -> str:
    return f"{ranks.namespace}/{what}"


def _bounded(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own, waited for at most STORE_WAIT_S (then None; the thread is left behind)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception:  # noqa: BLE001 - a store that fails: nothing to say, nothing lost
            pass

    t = threading.Thread(target=run, name="phase-timer-oom-store", daemon=True)
    t.start()
    t.join(STORE_WAIT_S)
    return result[0] if result else None


def publish(core: Any, directory: str | None) -> None:
    """Rank zero at the run's start, under torch.distributed: where its files go, so that a rank that runs out of
    memory writes its own beside them (one store request, once)."""
    ranks = core.ranks
    if ranks is None or ranks.rank != 0 or directory is None:
        return
    value = json.dumps({"summary_dir": core.summary_dir, "directory": directory})
    _bounded(lambda: ranks.store.set(_key(ranks, "dir"), value))


def _published(ranks: Any) -> dict[str, Any] | None:
    """What rank zero published (None: nothing, or not within STORE_WAIT_S: a rank that runs out in its first
    steps may get there before rank zero has opened its files)."""
    store, key = ranks.store, _key(ranks, "dir")

    def read() -> Any:
        deadline = time.monotonic() + STORE_WAIT_S * 0.9
        while not store.check([key]):  # get() would wait for a missing key as long as the store's timeout
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return json.loads(store.get(key))

    return _bounded(read)


def _from_this_rank(core: Any, facts: dict[str, Any]) -> None:
    """A rank other than zero ran out: its finding to rank zero through the store, and its own summary file beside
    rank zero's (where rank zero published it; nowhere when rank zero writes no files)."""
    ranks = core.ranks
    line = (json.dumps(facts, default=str) + "\n").encode()
    _bounded(lambda: ranks.store.append(_key(ranks, "oom"), line))
    where_to = (_published(ranks) or {}).get("summary_dir")
    if where_to:
        core.summary_dir, core.summary_name = where_to, rank_file_name(ranks.rank)

