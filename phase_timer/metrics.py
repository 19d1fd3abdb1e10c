"""Names and order of what is measured, and how it is written down."""

from __future__ import annotations

from phase_timer.stats import WINDOW_STATS, RunTotals

#: Built-in phases in display order.  Custom phases (plain-PyTorch door) go after them.
PHASE_ORDER = ("data_wait", "h2d", "forward", "backward", "optimizer", "idle")
#: Phases read on the host clock whatever the device.
HOST_PHASES = frozenset({"data_wait", "period"})
#: Totals, shown last.
TOTALS = ("step", "period")

WINDOW_PREFIX = "phase_time"
STEP_PREFIX = "phase_time_step"
SKIPPED_TAG = "phase_timer/skipped_steps"
WINDOW_STEPS_TAG = "phase_timer/window_steps"


def ordered(phases: set[str] | list[str]) -> list[str]:
    """Built-ins in their order, then custom phases alphabetically, then the totals."""
    present = set(phases)
    builtin = [p for p in PHASE_ORDER if p in present]
    totals = [p for p in TOTALS if p in present]
    custom = sorted(present - set(builtin) - set(totals))
    return builtin + custom + totals


def window_tag(phase: str, stat: str) -> str:
    return f"{WINDOW_PREFIX}/{phase}_ms/{stat}"


def step_tag(phase: str) -> str:
    return f"{STEP_PREFIX}/{phase}_ms"


def window_scalars(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flatten a window's statistics into ``{tag: value}``."""
    return {window_tag(p, s): summary[p][s] for p in ordered(list(summary)) for s in WINDOW_STATS}


def step_scalars(ms: dict[str, float]) -> dict[str, float]:
    return {step_tag(p): ms[p] for p in ordered(list(ms))}


def custom_scalars_layout(per_step: bool) -> dict[str, dict[str, list]]:
    """A TensorBoard custom-scalars layout: every phase of one statistic in one chart."""
    charts: dict[str, list] = {
        f"{stat} per phase (ms)": ["Multiline", [rf"^{WINDOW_PREFIX}/.*_ms/{stat}$"]] for stat in WINDOW_STATS
    }
    if per_step:
        charts["every step (ms)"] = ["Multiline", [rf"^{STEP_PREFIX}/.*_ms$"]]
    return {"phase-timer": charts}


def format_summary(totals: RunTotals, *, clock: str, title: str = "phase-timer") -> str:
    """The end-of-training table: per phase mean, p50, p90, max and share.

    Device phases show their share of ``step`` (total over total); ``data_wait`` its
    share of ``period`` (both on the host clock).  Percentiles are within 0.5% (1%-wide histogram buckets).
    """
    phases = ordered(list(totals.phases))
    if not phases:
        return f"{title}: no step was timed (warm-up longer than the run?)"
    step = totals.phases.get("step")
    period = totals.phases.get("period")
    head = ("phase", "clock", "mean ms", "p50 ms", "p90 ms", "max ms", "share")
    rows = []
    for p in phases:
        t = totals.phases[p]
        base = period if p in HOST_PHASES else step
        # time-weighted: a phase absent from some steps (idle, a custom phase) is not overstated
        share = "" if base is None or p in TOTALS or base.total <= 0 else f"{100 * t.total / base.total:5.1f}%"
        if p == "step":
            share = "100.0%"
        row_clock = "host" if p in HOST_PHASES else clock
        rows.append((p, row_clock, f"{t.mean:.3f}", f"{t.quantile(50):.3f}", f"{t.quantile(90):.3f}", f"{t.max:.3f}", share))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    rule = "-" * len(line(head))
    body = "\n".join(line(r) for r in rows)
    note = "share: device phases of `step`, data_wait of `period` (host)"
    return f"{title}: {totals.steps} steps timed\n{rule}\n{line(head)}\n{rule}\n{body}\n{rule}\n{note}"
