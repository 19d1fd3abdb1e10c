"""How what is measured is written down: the TensorBoard tags (every sink's keys) and the scalars of a window,
a step, the ranks and memory."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from phase_timer.phases import PHASE_ORDER, TOTALS, ordered
from phase_timer.timing.stats import WINDOW_STATS

if TYPE_CHECKING:
    from phase_timer.distributed.ranks import RankWindow

WINDOW_PREFIX = "phase_time"
STEP_PREFIX = "phase_time_step"
RANKS_PREFIX = "phase_time_ranks"
#: Across ranks, per phase, each rank's window mean: these, and which rank had the largest.
RANK_STATS = ("min", "median", "max", "slowest_rank")
RANKS_TAG = "phase_timer/ranks_reporting"
SKIPPED_TAG = "phase_timer/skipped_steps"
WINDOW_STEPS_TAG = "phase_timer/window_steps"
#: Per window: the mean over its sampled steps of the closed steps the device had not finished.
IN_FLIGHT_TAG = "phase_timer/steps_in_flight"
#: Memory (CUDA): a sampled step's allocator counters, at its own step (``phase_memory/<what>_mb``).
MEMORY_PREFIX = "phase_memory"
#: Across ranks, each rank's peak allocated (``phase_memory_ranks/peak_allocated_mb/{min,median,max,largest_rank}``).
MEMORY_RANKS_PREFIX = "phase_memory_ranks"
#: What a memory step writes, in display order: allocated at each boundary, then the run's peaks and the device.
MEMORY_ORDER = ("step_begin", "forward_begin", "backward_begin", "optimizer_begin", "idle_begin", "step_end",
                "activations", "reserved", "peak_allocated", "peak_reserved", "device_free")
#: Once, at the end: the verdict as text.
DIAGNOSIS_TAG = "phase_timer/diagnosis"


def window_tag(phase: str, stat: str) -> str:
    return f"{WINDOW_PREFIX}/{phase}_ms/{stat}"


def step_tag(phase: str) -> str:
    return f"{STEP_PREFIX}/{phase}_ms"


def window_scalars(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flatten a window's statistics into ``{tag: value}``."""
    scalars = {}
    for p in ordered(list(summary)):
        stats = summary[p]
        for s, tag in _window_tags(p):
            scalars[tag] = stats[s]
    return scalars


@functools.lru_cache(maxsize=256)
def _window_tags(phase: str) -> tuple[tuple[str, str], ...]:
    """(stat, tag) of a phase's window statistics: made once, not at every window."""
    return tuple((s, window_tag(phase, s)) for s in WINDOW_STATS)


def rank_tag(phase: str, stat: str) -> str:
    return f"{RANKS_PREFIX}/{phase}_ms/{stat}"


def rank_scalars(window: RankWindow) -> dict[str, float]:
    """One window across ranks as ``{tag: value}``."""
    out = {rank_tag(p, s): v for p in ordered(list(window.phases)) for s, v in window.stats(p).items()}
    out[RANKS_TAG] = float(window.ranks)
    peaks = window.peak_mb
    if peaks is not None and peaks.n >= 2:
        for stat, v in (("min", peaks.lo), ("median", peaks.median()), ("max", peaks.hi),
                        ("largest_rank", float(peaks.hi_rank))):
            out[f"{MEMORY_RANKS_PREFIX}/peak_allocated_mb/{stat}"] = v
    return out


def step_scalars(ms: dict[str, float]) -> dict[str, float]:
    return {step_tag(p): ms[p] for p in ordered(list(ms))}


def memory_tag(what: str) -> str:
    return f"{MEMORY_PREFIX}/{what}_mb"


def memory_scalars(mb: dict[str, float]) -> dict[str, float]:
    """A memory step's values (MB) as ``{tag: value}``."""
    return {memory_tag(k): mb[k] for k in (*MEMORY_ORDER, *sorted(set(mb) - set(MEMORY_ORDER))) if k in mb}


def custom_scalars_layout(per_step: bool, ranks: bool = False) -> dict[str, dict[str, list]]:
    """A TensorBoard custom-scalars layout: every phase of one statistic in one chart."""
    charts: dict[str, list] = {
        f"{stat} per phase (ms)": ["Multiline", [rf"^{WINDOW_PREFIX}/.*_ms/{stat}$"]] for stat in WINDOW_STATS
    }
    if per_step:
        charts["every step (ms)"] = ["Multiline", [rf"^{STEP_PREFIX}/.*_ms$"]]
    charts["memory: allocated at each boundary (MB)"] = ["Multiline", [rf"^{MEMORY_PREFIX}/.*_(begin|end)_mb$"]]
    charts["memory: activations, peaks, reserved (MB)"] = [
        "Multiline", [rf"^{MEMORY_PREFIX}/(activations|reserved|peak_allocated|peak_reserved)_mb$"]]
    layout = {"phase-timer": charts}
    if ranks:  # one chart per built-in phase: its min, median and max across ranks
        layout["phase-timer across ranks"] = {
            f"{phase} across ranks (ms)": ["Multiline", [rf"^{RANKS_PREFIX}/{phase}_ms/(min|median|max)$"]]
            for phase in (*PHASE_ORDER, *TOTALS)
        }
        layout["phase-timer across ranks"]["slowest rank per phase"] = ["Multiline", [rf"^{RANKS_PREFIX}/.*_ms/slowest_rank$"]]
    return layout
