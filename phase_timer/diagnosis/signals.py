"""The signals the rules read that the run totals do not hold: the sampled steps in flight and host step times,
each window's spread, the ranks' windows, the CPU's use."""

from __future__ import annotations

from collections import Counter
from typing import Any

from phase_timer.diagnosis.cpu_use import CpuUse
from phase_timer.diagnosis.finding import SPIKE_MAX, SPIKE_P90, STRAGGLER_MARGIN, WAIT_PHASES
from phase_timer.diagnosis.run_change import RankShifts
from phase_timer.phases import BETWEEN, BETWEEN_PREFIX, FETCH, TOTALS, exposed_wait


class Signals:
    """What the rules read, gathered during the run (per window or on sampled steps, never per step)."""

    def __init__(self) -> None:
        #: Steps in flight at each sampled close (CUDA clock only): earlier steps the device had not finished.
        self.flight: Counter[int] = Counter()
        #: Of the sampled closes with none in flight, those at which the step just ended was still running too
        #: (evidence only: a host-bound loop with a heavy optimizer tail reads busy here too).
        self.tail_checked = 0
        self.tail_busy = 0
        #: At sampled steps' boundaries: how often the device had not yet begun the span the host had just
        #: issued (more than a phase behind the host inside the step), of the boundaries checked.
        self.behind_checked = 0
        self.behind = 0
        #: Sampled steps' host time from the step's begin to its end (ms), and phase-timer's own host time (ns,
        #: window ends out); and the own host time of the ordinary steps timed apart (``phase_timer.run.own_cost``).
        self.host_step_ms: list[float] = []
        self.own_ns: list[int] = []
        self.plain_ns: list[int] = []
        #: The sampled steps' mean gap once sparse (set by the boundaries): the own-cost line's long-run rate.
        self.sample_gap: float | None = None
        self.windows = 0
        self.spiky_windows = 0
        #: The part of ``data_wait`` that reached the device (device clock; ``phases.exposed_wait``), ms over the
        #: steps of the windows that had a ``data_wait``, each window's own; and those windows' steps.
        self.wait_exposed_ms = 0.0
        self.wait_steps = 0
        #: Per (phase, rank): windows in which the rank was slowest by a material margin, and the margins (ms).
        self.slowest: Counter[tuple[str, int]] = Counter()
        self.margins: dict[tuple[str, int], float] = {}
        self.rank_period_ms: list[float] = []
        #: The model is sharded with FSDP2 (``fully_shard``): COMM_BOUND gives its advice (set by comm/fsdp.py).
        self.fsdp2 = False
        #: The CPU time of the training process, its training thread and the loader's workers, read at a few
        #: window ends (``phase_timer.diagnosis.cpu_use``): what the INPUT_BOUND advice is made of.
        self.cpu = CpuUse()
        #: Each window's per-phase medians in step order (the core's ``stats.WindowSeries``) and, on rank zero
        #: of a distributed run, each window's slowest rank a phase: what RUN_CHANGED reads.
        self.series: Any = None
        self.rank_shifts = RankShifts()

    def add_wait(self, steps: int, summary: dict[str, dict[str, float]],
                 sizes: dict[str, int] | None = None, *, whole: bool = False) -> float | None:
        """One window's part of ``data_wait`` that reached the device (ms over its steps; None: no data_wait), from
        its statistics and each phase's count of values (``sizes``; default: every step).  ``whole``: the fetch
        runs inside the step's own span (Lightning's ``training_step(self, dataloader_iter)``), where the device's
        idle over it lands in ``forward``, not between the steps: the whole wait is taken as reaching the device,
        as on the host clock."""
        if FETCH not in summary:
            return None
        sizes = sizes or {}
        if whole:
            exposed = summary[FETCH]["mean"] * sizes.get(FETCH, steps) / steps if steps else None
        else:
            kept = [p for p in summary if p in (FETCH, BETWEEN, *TOTALS) or p.startswith(BETWEEN_PREFIX)]
            counts = {p: sizes.get(p, steps) for p in kept}
            exposed = exposed_wait({p: summary[p]["mean"] * counts[p] for p in kept}, counts, steps)
        if exposed is None:
            return None
        self.wait_exposed_ms += exposed * steps
        self.wait_steps += steps
        return exposed * steps

    def add_window(self, steps: int, summary: dict[str, dict[str, float]]) -> None:
        """One window's statistics: is it spiky?"""
        if steps < 10:
            return
        self.windows += 1
        mean = (summary.get("period") or {}).get("mean")
        if mean is not None:
            self.cpu.add_window(steps, steps * mean)
        for total in ("step", "period"):
            s = summary.get(total)
            if s and s["p50"] > 0 and (s["p90"] / s["p50"] >= SPIKE_P90 or s["max"] / s["p50"] >= SPIKE_MAX):
                self.spiky_windows += 1
                return

    def add_rank_window(self, spreads: dict[str, Any], step: int | None = None) -> None:
        """One window across ranks (each phase's ``ranks.Spread``), ending at ``step``: which rank was slowest in
        each phase, by how much."""
        if step is not None:
            self.rank_shifts.add(step, spreads)
        scale_of = spreads.get("period") or spreads.get("step")
        if scale_of is None or scale_of.n < 2:
            return
        scale = scale_of.median()
        self.rank_period_ms.append(scale)
        for phase, spread in spreads.items():
            if phase in WAIT_PHASES or spread.n < 2:  # a rank's wait for the others is no lag
                continue
            slow = spread.hi_rank
            margin = spread.hi - spread.median_of_rest()
            if margin >= max(0.05, STRAGGLER_MARGIN * scale):
                self.slowest[phase, slow] += 1
                self.margins[phase, slow] = self.margins.get((phase, slow), 0.0) + margin
