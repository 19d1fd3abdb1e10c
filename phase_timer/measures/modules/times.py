"""Which module's measure (:class:`ModuleTimes`): the schedule of sampled steps, the rows' statistics, and what
they give the table, the sinks, the summary file and the verdict."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from phase_timer._env import warn
from phase_timer.measure import Measure
from phase_timer.measures.modules.gate import _Gate
from phase_timer.measures.modules.ranks import block as rank_block
from phase_timer.measures.modules.ranks import report_key, slow_modules
from phase_timer.measures.modules.ranks import text as rank_text
from phase_timer.measures.modules.sample import Sample
from phase_timer.measures.modules.tree import build_tree, tag_key

log = logging.getLogger(__name__)

#: The first samples after the warm-up come DENSE_GAP steps apart, DENSE of them (and the one the last schedules), or
#: as many as the groups where there are more (a short run gets every row) ...
DENSE = 4
DENSE_GAP = 8
#: ... on the device's clock.  On the host clock a sampled step's phases hold its hooks' host time (the host clock
#: is the work), which would make every window of a cheap step read spiky (UNSTABLE): there, HOST_DENSE of them.
HOST_DENSE = 0
#: ... then one in GAP (at random in it, so that no periodic work aliases with the samples): a mean of 1,024 steps,
#: so that a row is read again about every 5,000 steps of a long run (a 12-layer GPT-2's 5 groups).
GAP = (640, 1408)
GAP_MEAN = sum(GAP) // 2
#: The generator's seed: the same steps sampled in every run (a recorded run stays the same).
SEED = 50
#: CUDA: a group's first sample, then one of its samples in ACT_EVERY, also reads the allocator around each forward
#: (activations): a read is 10-24 µs of host time, taken outside the module's own marks, inside its parent's (the gate
#: keeps the device's spans clear of the host's time).
ACT_EVERY = 4
#: CUDA: a sample's gate (``gate._Gate``), so that its marks hold device time only.
GATE = True
#: Samples kept per module for the summary file's raw values (the most recent).
RAW_KEPT = 32
#: The table names this many modules of each of forward and backward.
TABLE_TOP = 3
PREFIX = "phase_module"
#: Said when no sample could be resolved (the summary's note; the table's line).
NOT_COMPILED_NOTE = ("hooks do not fire inside a compiled region (torch.compile) or a CUDA graph's replay, so its "
                     "modules' times are not known here; a run without compile measures them")


# -- the measure ------------------------------------------------------------------------------------


class _Stat:
    __slots__ = ("n", "total", "raw")

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.raw: list[float] = []

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v
        self.raw.append(v)
        if len(self.raw) > RAW_KEPT:
            del self.raw[0]

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


class ModuleTimes(Measure):
    """Per module of the model: forward and backward time and activations, on sampled steps (see the module).

    The boundaries call :meth:`begin` when a step at or after :attr:`next_due` begins (a plain step, past the
    warm-up), and :meth:`close` (or :meth:`drop`) when it closes; the core hears the results as any measure."""

    key = "modules"

    def __init__(self, models: Iterable[nn.Module], spec: Any = True, *, clock: Any,
                 allocated: Callable[[], int] | None = None, warmup_steps: int = 0, owner: str = "attach",
                 dense: int = DENSE, gate: bool = False, ranks: Any = None) -> None:
        self.spec = spec
        #: The rank exchange (``distributed.ranks.RankExchange``; None: one process): each rank's rows reach rank
        #: zero with its window reports (:meth:`report`), and rank zero names the slow rank's module (``ranks.py``).
        self.ranks = ranks
        self._sent: dict[str, float] = {}  # the leaf rows' sums (and counts) read since the last report
        self.clock = clock
        #: The allocator's allocated bytes now (no sync); None: activations are not measured (the CPU).
        self.allocated = allocated
        #: CUDA: the gate that holds a sample's kernels until the host has queued them (None: the host clock).
        self.gate: _Gate | None = _Gate(clock) if gate else None
        self.uncovered = 0  # spans a gate did not cover (not read)
        self.nodes = 0  # autograd node hooks put on, over the samples
        self.tree = build_tree(list(models), spec, owner)  # the models are not kept: the tree holds its modules weakly
        parents = {e.parent for e in self.tree.entries.values()}
        self._leaf_keys = frozenset(k for k in self.tree.entries if k not in parents)  # the rows a rank reports
        #: The groups of rows a sample hooks, in turn (:meth:`Tree.groups`); per group, its samples taken (a dropped
        #: step's is taken again next), those read with every span covered (or on a step where none of its modules
        #: ran), and those read that read the allocator.
        self.groups = self.tree.groups()
        self._visits = [0] * len(self.groups)
        self._clean = [0] * len(self.groups)
        self._acts = [0] * len(self.groups)
        self._rng = random.Random(SEED)
        self._next = warmup_steps + 2  # steps begun, 1-based: past the warm-up and its first timed step
        self._dense = 0
        # steps sampled DENSE_GAP apart before the sparse gap: enough for every group once
        self._dense_n = max(dense, len(self.groups) - 1) if dense > 0 else 0
        self.sample: Sample | None = None
        self._pending: list[Sample] = []
        self._pilot: tuple[int, int] | None = None  # (steps begun, host ns) at the step before a sample's begin
        self.samples = 0  # read
        self.dropped = 0
        self.stats: dict[str, dict[str, _Stat]] = {}
        self._window: dict[str, dict[str, float]] = {}  # the rows read since the last window (the latest of each)
        self._tags: dict[str, str] = {}  # a row's scalars' prefix
        #: Host time spent on samples (hooks, search, marks, registration) and the steps begun, for the cost.
        self.own_ns = 0
        self.steps_begun = 0
        self.failed: str | None = None
        self.ended = False  # the run's end was heard (`end`): the verdict reads the block from then on
        self.shares: dict[str, dict[str, float]] = {}
        self._phase_ms: dict[str, float] = {}

    @property
    def active(self) -> bool:
        """Anything to hook (not turned off, not a compiled model)."""
        return bool(self.tree.targets) and self.failed is None

    @property
    def untimed(self) -> bool:
        """A sampled step is left out of the phases' statistics (the device's clock: a sample holds the gate, and
        may read the allocator in the step).  On the host clock it stays timed."""
        return getattr(self.clock, "kind", None) == "cuda"

    @property
    def next_due(self) -> int:
        """The step (begun, 1-based) to sample next (a very large number: never)."""
        return self._next if self.active else 1 << 62

    # -- the boundaries ---------------------------------------------------------------------------
    def begin(self, begun: int, step: int) -> bool:
        """A sampled step begins: the next group's hooks on (the group with the fewest samples kept, the first
        such).  False: not sampled (failed)."""
        t0 = time.perf_counter_ns()
        if self._pending:  # what is done is read now (a query each): the gate is sized from the freshest
            self._read()
        visits = self._visits
        part = self._next_part()
        self._schedule(begun)
        read = self.allocated if self.allocated is not None and visits[part] % ACT_EVERY == 0 else None
        visits[part] += 1
        sample = Sample(self, step, part, self.groups[part], read)
        pilot, self._pilot = self._pilot, None
        host_ms = (t0 - pilot[1]) / 1e6 if pilot is not None and pilot[0] == begun - 1 else None
        try:
            sample.install(self.tree)
            if self.gate is not None:
                sample.gate = self.gate.hold(part, host_ms)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            sample.remove()
            self._fail(err)
            return False
        self.sample = sample
        self.own_ns += time.perf_counter_ns() - t0
        return True

    def pilot(self, begun: int) -> None:
        """The step before a sample has begun (the boundaries call it where a gate is sized): its host time, read at
        the sample's begin, sizes the run's first gate (:meth:`_Gate.length`)."""
        self._pilot = (begun, time.perf_counter_ns())

    def _unread(self) -> list[int]:
        """Groups with no sample read whole, none waiting to be read, and a gate that can cover them (not futile)."""
        waiting = {s.part for s in self._pending}
        acts = self._acts if self.allocated is not None else self._clean
        futile = self.gate.futile if self.gate is not None else ()
        return [g for g, (n, a) in enumerate(zip(self._clean, acts))
                if not (n and a) and g not in waiting and g not in futile]

    def _next_part(self) -> int:
        """The group a sample hooks: of those with no sample read whole (none waiting, not futile), the one with the
        fewest samples taken; else the one with the fewest (the first such)."""
        visits = self._visits
        unread = self._unread()
        if unread:
            return min(unread, key=visits.__getitem__)
        return visits.index(min(visits))

    def _schedule(self, begun: int) -> None:
        """The next sample's step: DENSE_GAP on while the dense samples last, then the sparse gap from the seeded
        generator.  It never depends on what was read, so that every rank of a distributed run samples the same steps
        (a rank's gate holds its collectives: on a step its peers time, their waits would hold it)."""
        if self._dense < self._dense_n:
            self._dense += 1
            self._next = begun + DENSE_GAP
        else:
            self._next = begun + self._rng.randint(*GAP)

    def close(self, recorded: bool) -> None:
        """The sampled step closed (``recorded``: its phases were timed): hooks off, its marks wait to be read."""
        t0 = time.perf_counter_ns()
        sample, self.sample = self.sample, None
        if sample is None:
            return
        sample.remove()
        self.nodes += sample.nodes
        if sample.failed is not None:
            self._fail(RuntimeError(sample.failed))
        if recorded and sample.failed is None and (sample.forward or sample.activation):
            self._pending.append(sample)
        else:
            self.dropped += 1
            if recorded and sample.failed is None:  # none of its modules ran on this step: nothing to read
                self._clean[sample.part] += 1
                self._acts[sample.part] += 1
            else:
                self._visits[sample.part] -= 1  # not a training step's: its group is taken again next
            sample.release()
        self.own_ns += time.perf_counter_ns() - t0 + sample.host_ns

    def drop(self) -> None:
        """The step was dropped or paused: what its hooks measured is not a training step's."""
        self.close(False)

    def _fail(self, err: Exception) -> None:
        self.failed = f"{type(err).__name__}: {err}"
        warn(log, f"phase-timer: modules are no longer measured ({self.failed}); the time phases go on", 4)

    def _read(self, final: bool = False) -> None:
        """The pending samples whose marks are all done (a query each; never a wait): folded in, and their rows kept
        for the next window's scalars."""
        keep = []
        for sample in self._pending:
            if not sample.done():
                if not final:
                    keep.append(sample)
                else:
                    sample.release()
                continue
            vals = sample.values()
            self.uncovered += sample.uncovered
            sample.release()
            self.samples += 1
            self._clean[sample.part] += not sample.uncovered
            self._acts[sample.part] += sample.read is not None
            sent = self._sent
            for key, row in vals.items():
                stats = self.stats.setdefault(key, {})
                for name, v in row.items():
                    stats.setdefault(name, _Stat()).add(v)
                    if (name == "forward_ms" or name == "backward_ms") and key in self._leaf_keys:
                        k = report_key(key, name)
                        sent[k] = sent.get(k, 0.0) + v
                        sent[k + "#"] = sent.get(k + "#", 0.0) + 1.0
            self._window.update(vals)
        self._pending = keep

    # -- Measure -----------------------------------------------------------------------------------
    def window(self, columns: dict[str, list[float]]) -> dict[str, float]:
        t0 = time.perf_counter_ns()
        if self.gate is not None and columns.get("period"):
            period = columns["period"]  # sorted
            self.gate.bound(period[len(period) // 2])
        if self._pending:
            self._read()
        out: dict[str, float] = {}
        tags = self._tags
        for key, row in self._window.items():
            tag = tags.get(key)
            if tag is None:
                tag = tags[key] = f"{PREFIX}/{tag_key(key)}/"
            for name in ("forward_ms", "backward_ms", "recompute_ms", "activation_mb"):
                if name in row:
                    out[tag + name] = row[name]
        self._window = {}
        self.own_ns += time.perf_counter_ns() - t0
        return out

    def report(self) -> dict[str, float]:
        """This rank's leaf rows read since its last report: their summed forward and backward ms, and counts (the
        rows the table's modules line shows; their sums never count a time twice)."""
        sent, self._sent = self._sent, {}
        return sent

    def _rank_totals(self) -> Any:
        """Rank zero's totals of every rank (None: one process, or another rank)."""
        return getattr(self.ranks, "totals", None) if self.ranks is not None else None

    def end(self, totals: Any) -> list[str]:
        self._read(final=True)
        phases = getattr(totals, "phases", {}) or {}
        for phase in ("forward", "backward"):
            t = phases.get(phase)
            if t is not None and t.mean:
                self._phase_ms[phase] = t.mean
        self.steps_begun = getattr(totals, "steps", 0) or self.steps_begun
        self.ended = True
        return []

    def verdict(self) -> dict[str, Any]:
        """What the verdict's rules read (``diagnose``'s ``modules``): the summary block, at the run's end only.
        Before it the shares of the run's phases are not known, and the live file's thread would walk the
        statistics the training thread fills: the verdict so far goes without it."""
        return {"modules": self.summary()} if self.ended else {}

    def rows(self) -> dict[str, dict[str, Any]]:
        """Per row, in the tree's order: means over the samples, shares of the run's phases, kind and parent."""
        out: dict[str, dict[str, Any]] = {}
        for key, entry in self.tree.entries.items():
            stats = self.stats.get(key)
            if not stats:
                continue
            row: dict[str, Any] = {"kind": entry.kind, "parent": entry.parent, "modules": entry.modules}
            for name in ("forward_ms", "backward_ms", "recompute_ms", "activation_mb", "calls"):
                s = stats.get(name)
                row[name] = s.mean if s is not None else None
            for phase in ("forward", "backward"):
                v, base = row[f"{phase}_ms"], self._phase_ms.get(phase)
                row[f"share_of_{phase}"] = v / base if v is not None and base else None
            row["samples"] = stats["calls"].n if "calls" in stats else 0
            row["raw"] = {n: list(s.raw) for n, s in stats.items() if n != "calls"}
            out[key] = row
        return out

    def leaves(self, rows: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The rows no other row is under: the most specific ones (their sum never counts a time twice)."""
        rows = self.rows() if rows is None else rows
        parents = {r["parent"] for r in rows.values()}
        return {k: r for k, r in rows.items() if k not in parents}

    def host_cost(self) -> dict[str, float] | None:
        """Host time: a sampled step's (ms), and a step's amortized (µs); None before a sample.  (The summary
        block's ``cost``; not :meth:`Measure.cost`, whose keywords are the own-cost line's.)"""
        n = self.samples + self.dropped
        if not n:
            return None
        per = self.own_ns / n / 1e6
        out = {"sampled_step_ms": per, "us_per_step": per * 1e3 / (GAP_MEAN if n > self._dense_n else max(1, DENSE_GAP))}
        if self.gate is not None:  # spans the gate did not cover (not read), and the gate's last length
            out["uncovered"] = float(self.uncovered)
            out["gate_ms"] = self.gate.ms
            out["gates_capped"] = float(self.gate.capped)
            out["gates_futile"] = float(len(self.gate.futile))
        return out

    def groups_read(self) -> int:
        """Groups of rows with a sample read whole (every span covered; on CUDA one that read the allocator too)."""
        acts = self._acts if self.allocated is not None else self._clean
        return sum(1 for n, a in zip(self._clean, acts) if n and a)

    @property
    def complete(self) -> bool:
        """Every group of rows has a sample read whole: every row that ran has its figures (the verdict names a
        module only then: a part of the table could name the largest of what was read, not the largest)."""
        return self.groups_read() == len(self.groups)

    def note(self) -> str | None:
        """Why some or all modules are not measured (None: nothing to say)."""
        t = self.tree
        if t.whole_compiled and not t.targets:
            return f"not measured: the model is compiled (torch.compile); {NOT_COMPILED_NOTE}"
        if t.compiled:
            return f"not measured: {', '.join(t.compiled[:4])}{' ...' if len(t.compiled) > 4 else ''} (compiled); " + \
                NOT_COMPILED_NOTE
        if self.failed is not None:
            return f"stopped: {self.failed}"
        return None

    def line(self) -> str | None:
        note = self.note()
        rows = self.leaves()
        if not rows:
            if note is not None:
                return f"modules: {note}"
            return None if self.spec is False else "modules: no sampled step was read (too few steps)"
        parts = []
        for phase in ("forward", "backward"):
            top = sorted(((r[f"{phase}_ms"], k) for k, r in rows.items() if r[f"{phase}_ms"] is not None),
                         reverse=True)[:TABLE_TOP]
            shown = ", ".join(f"{k} {v:.2f} ms" + (f" ({_pct(rows[k][f'share_of_{phase}'])})"
                                                   if rows[k][f"share_of_{phase}"] is not None else "")
                              for v, k in top)
            if shown:
                parts.append(f"{phase}: {shown}")
        read = "" if self.complete else f", {self.groups_read()} of {len(self.groups)} groups of rows read"
        text = f"modules ({self.samples} sampled steps{read}, inclusive): " + "; ".join(parts)
        act = sorted(((r["activation_mb"], k) for k, r in rows.items() if r["activation_mb"] is not None), reverse=True)
        if act:
            text += "; activations: " + ", ".join(f"{k} {v:.0f} MB" for v, k in act[:TABLE_TOP])
        totals = self._rank_totals()
        slow = rank_text(slow_modules(totals, set(rows))) if totals is not None else None
        if slow is not None:
            text += f"; {slow}"
        if note is not None:
            text += f"; {note}"
        return text

    def summary(self) -> dict[str, Any] | None:
        if self.spec is False:
            return None
        rows = self.rows()
        cost = self.host_cost()
        out = {
            "spec": self.spec if not isinstance(self.spec, tuple) else list(self.spec),
            "clock": getattr(self.clock, "kind", None),
            "samples": self.samples,
            "dropped": self.dropped,
            "groups": len(self.groups),
            "groups_read": self.groups_read(),
            "complete": self.complete,
            "activations": "measured" if self.allocated is not None else "not measured: no allocator counters on the host clock",
            "inclusive": True,
            "rows": rows,
            "leaves": sorted(self.leaves(rows)),
            "compiled": list(self.tree.compiled),
            "note": self.note(),
            "cost": cost,
        }
        totals = self._rank_totals()
        if totals is not None:  # rank zero of a distributed run: every rank's rows, and the slow rank's module
            out["ranks"] = rank_block(totals, set(out["leaves"]))
        return out


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def make(models: Sequence[nn.Module], spec: Any, clock: Any, *, warmup_steps: int, owner: str,
         ranks: Any = None) -> ModuleTimes | None:
    """The measure for a run (None: ``modules=False`` or no model).  On CUDA, activations from the allocator's
    counters (``torch._C._cuda_memoryStats``: no sync); a separate instance of the run's clock, so that the core's
    stream bookkeeping never sees a module's mark."""
    if spec is False or not models:
        return None
    allocated = None
    own_clock = clock
    cuda = getattr(clock, "kind", None) == "cuda"
    if cuda:
        from phase_timer.measures.memory import cuda_reader

        index = clock.device.index
        reader = cuda_reader(index)
        allocated = lambda: reader().allocated  # noqa: E731
        own_clock = type(clock)(clock.device)
    dense = DENSE if getattr(clock, "kind", None) != "host" else HOST_DENSE
    return ModuleTimes(models, spec, clock=own_clock, allocated=allocated, warmup_steps=warmup_steps, owner=owner,
                       dense=dense, gate=cuda and GATE, ranks=ranks)
