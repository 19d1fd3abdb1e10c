"""``phase-timer report``'s text: one table per run with the lines below it, then the runs side by side."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from phase_timer.cli import rates
from phase_timer.cli.report_runs import PhaseStats, RunReport
from phase_timer.phases import ordered
from phase_timer.outputs.run_summary import FILE_NAME
from phase_timer.outputs.table import _mb, format_memory, format_own_cost, share_note
from phase_timer.outputs.tags import MEMORY_PREFIX

_HEADERS = {
    "summary": ("mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms"),
    "step": ("mean ms", "p50 ms", "p90 ms", "max ms"),
    "window": (
        "mean ms\n(mean of\nwindow means)",
        "p50 ms\n(median of\nwindow p50)",
        "p90 ms\n(max of\nwindow p90)",
        "max ms\n(max of\nwindow max)",
    ),
}


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def percent(v: float | None) -> str:
    """A share as the tables and the figure print it (``41.2%``); blank where unknown."""
    return "" if v is None else f"{100 * v:.1f}%"


def _describe(report: RunReport) -> str:
    if report.source == "summary":
        steps = (report.summary or {}).get("steps") or {}
        what = (f"{report.steps} steps timed, {report.skipped_steps} skipped (max_pending), {steps.get('warmup', 0)} "
                f"warm-up; the run's own statistics over every timed step, from its {FILE_NAME} "
                "(percentiles within 0.5%)")
        if report.clock:
            what += f"; the step's phases on the {report.clock} clock"
    elif report.source == "step":
        what = f"{report.steps} steps timed; exact statistics over per-step values"
    else:
        what = f"{report.windows} logging windows; summaries of the window summaries (per-step values not logged)"
    if report.skipped_steps:
        what += f"; {report.skipped_steps} steps skipped (max_pending) and not in these numbers"
    return f"run: {report.run}\n{what}"


def format_run(report: RunReport) -> str:
    """One run's table: phase, four statistics in ms, share."""
    from tabulate import tabulate

    exact = report.source == "summary"
    rows = [
        (p, _ms(s.mean_ms), _ms(s.p50_ms), _ms(s.p90_ms), *((_ms(s.p99_ms),) if exact else ()), _ms(s.max_ms),
         percent(s.share))
        for p, s in report.phases.items()
    ]
    headers = ("phase", *_HEADERS[report.source], "share")
    table = tabulate(rows, headers=headers, disable_numparse=True, colalign=("left",) + ("right",) * (len(headers) - 1))
    extra = summary_lines(report.summary) if report.summary is not None else []
    memory = memory_block(report.memory)
    mods = modules_block((report.summary or {}).get("modules"))
    # In the run's own order: its rates and MFU, then memory, then the modules, then the rest.
    return "\n".join([_describe(report), table, share_note(report.clock, report.phases),
                      *rates.run_lines(report.throughput, report.flops), *([memory] if memory else []),
                      *([mods] if mods else []), *extra])


def modules_block(block: dict[str, Any] | None) -> str | None:
    """The summary file's ``modules`` block as a table: each row's forward, backward (ms a step, inclusive: a row's
    time holds the rows under it), shares of the run's phases and activations; or its note when nothing was read."""
    from tabulate import tabulate

    if not block:
        return None
    rows = block.get("rows") or {}
    if not rows:
        return f"modules: {block.get('note') or 'no sampled step was read'}"

    def n(v: float | None, fmt: str = ".3f") -> str:
        return "" if v is None else format(v, fmt)

    leaves = set(block.get("leaves") or ())
    table = [(k if r.get("parent") is None else "  " + k, r.get("kind") or "", n(r.get("forward_ms")),
              percent(r.get("share_of_forward")), n(r.get("backward_ms")), percent(r.get("share_of_backward")),
              n(r.get("recompute_ms")), n(r.get("activation_mb"), ".0f"), "" if k in leaves else "parent")
             for k, r in rows.items()]
    heads = ("module", "kind", "forward ms", "of fwd", "backward ms", "of bwd", "recompute ms", "activ. MB", "")
    head = (f"modules: {block.get('samples', 0)} sampled steps on the {block.get('clock')} clock; inclusive (a parent "
            f"holds its rows); activations {block.get('activations')}")
    note = [f"modules: {block['note']}"] if block.get("note") else []
    return "\n".join([head, tabulate(table, headers=heads, disable_numparse=True), *note])


def has_memory(memory: dict[str, Any] | None) -> bool:
    """Memory was read and at least one memory step closed (``memory`` may be a summary file's or TensorBoard's)."""
    return bool(memory and memory.get("samples") and memory.get("peak_allocated_mb") is not None)


def memory_block(memory: dict[str, Any] | None) -> str | None:
    """The run's memory block: the summary file's as the run printed it, else TensorBoard's; None: no memory data."""
    if memory is None or not has_memory(memory):
        return None  # memory not read (a CPU, the host clock, memory=False): absent, so nothing is printed
    if memory.get("source") != "tensorboard":
        return format_memory(memory)
    alloc = memory.get("allocated_mb") or {}
    names = (("step_begin", "at the step's begin"), ("activations", "activations"))
    means = ", ".join(f"{name} {_mb(alloc[k]['mean'])}" for k, name in names if alloc.get(k))
    peaks = (f"peak allocated {_mb(memory.get('peak_allocated_mb'))}, "
             f"peak reserved {_mb(memory.get('peak_reserved_mb'))}")
    return (f"memory (from TensorBoard's {MEMORY_PREFIX}/* scalars, {memory['samples']} sampled steps; no "
            f"{FILE_NAME}): allocated {means or 'not logged'} (mean of {memory['steady_samples']}); "
            f"{peaks} (last values)")


def run_labels(reports: Sequence[RunReport]) -> list[str]:
    """Short names: each run's path below the runs' common parent."""
    paths = [os.path.abspath(r.run) for r in reports]
    if len(paths) < 2:
        return [os.path.join(*p.split(os.sep)[-2:]) for p in paths]
    common = os.path.commonpath(paths)
    return [os.path.relpath(p, common) if p != common else os.path.basename(p) for p in paths]


def _mean_and_share(stats: PhaseStats | None) -> str:
    if stats is None:
        return ""
    return _ms(stats.mean_ms) + ("" if stats.share is None else f" ({percent(stats.share)})")


def format_comparison(reports: Sequence[RunReport]) -> str:
    """Runs side by side: each phase's mean ms (share) per run."""
    from tabulate import tabulate

    labels = run_labels(reports)
    phases = ordered({p for r in reports for p in r.phases})
    rows = [("source", *(r.source for r in reports))]
    rows += [(p, *(_mean_and_share(r.phases.get(p)) for r in reports)) for p in phases]
    if any(has_memory(r.memory) for r in reports):  # a run without memory data: blank, not zero
        rows.append(("peak allocated", *(_mb(r.memory["peak_allocated_mb"]) if has_memory(r.memory) else ""
                                         for r in reports)))
    rows += rates.side_by_side_rows([r.throughput for r in reports], [r.flops for r in reports])
    align = ("left",) + ("right",) * len(reports)
    table = tabulate(rows, headers=("mean ms (share)", *labels), disable_numparse=True, colalign=align)
    return f"side by side ({len(reports)} runs)\n{table}"


def format_text(reports: Sequence[RunReport]) -> str:
    parts = [format_run(r) for r in reports]
    if len(reports) > 1:
        parts.append(format_comparison(reports))
    return "\n\n".join(parts)


def summary_lines(data: dict[str, Any]) -> list[str]:
    """What a summary file adds below the table: steps in flight, phase-timer's own cost, the syncs, the verdict."""
    from phase_timer.diagnosis import Diagnosis, format_verdict
    from phase_timer.distributed.rank_view import summary_table
    from phase_timer.measures.syncs import SyncSite, format_census

    lines = []
    if data.get("interrupted"):
        lines.append("the run was interrupted: these numbers cover the steps timed before that")
    flight = data.get("steps_in_flight")
    if flight:
        ahead = "the host ran ahead of the GPU" if flight["median"] >= 1 else "the GPU mostly caught up at each step's end"
        lines.append(f"steps in flight: median {flight['median']:g}, mean {flight['mean']:.1f}, over "
                     f"{flight['samples']} sampled step ends ({ahead})")
    own = data.get("own_cost")
    if own:
        lines.append(format_own_cost(own))
    syncs = data.get("syncs")  # version 3
    census = syncs and format_census(syncs["census"], syncs.get("step"), [SyncSite.from_dict(d) for d in syncs["sites"]],
                                     syncs["count"], syncs.get("paused", 0))
    if census:
        lines.append(census)
    ranks = summary_table(data.get("ranks"))  # every rank's means (distributed runs)
    if ranks:
        lines.append(ranks)
    if data.get("diagnosis"):
        lines.append(format_verdict(Diagnosis.from_dict(data["diagnosis"])))
    return lines
