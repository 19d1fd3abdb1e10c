"""One frame of ``phase-timer watch``: a :class:`~phase_timer.cli.watch_state.RunState` drawn with ``rich``.

Top to bottom: the run and its state; the phase bars (each phase's mean, its bar its part of ``period``
or of ``step``, as the table's share column); period, throughput and MFU with their trend over the last
windows; exposed communication; memory; the ranks; the verdict and its first advice; phase-timer's own
cost.  What a run does not have (no MFU on the host clock, no memory on a CPU) is left out, not shown as 0.
"""

from __future__ import annotations

from typing import Any

from phase_timer.cli.rates import RATES, format_rate, headline_rate
from phase_timer.cli.watch_state import RunState
from phase_timer.phases import share_base

BAR_WIDTH = 30
_SPARK = "▁▂▃▄▅▆▇█"
#: A change smaller than this (relative) is no trend.
FLAT = 0.02
_STATUS = {"waiting": "[yellow]waiting for its first window[/]", "running": "[green]running[/]",
           "ended": "[blue]ended[/]", "gone": "[red]gone[/]"}
_SEVERITY = {"high": "red", "medium": "yellow", "info": "cyan"}


def sparkline(values: list[float]) -> str:
    """``▁▃▅█``: each value's height between the smallest and the largest."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - lo) / span * len(_SPARK)))] if span > 0 else _SPARK[3]
                   for v in values)


def trend(values: list[float]) -> str:
    """The newest value against the mean of the (up to) four before it: ``▲ +4.1%``, ``▼ -2.3%`` or ``=``."""
    if len(values) < 2:
        return ""
    before = values[-5:-1]
    base = sum(before) / len(before)
    if base == 0:
        return ""
    change = values[-1] / base - 1
    return "=" if abs(change) < FLAT else f"{'▲' if change > 0 else '▼'} {100 * change:+.1f}%"


def _bar(fraction: float) -> str:
    full = max(0.0, min(1.0, fraction)) * BAR_WIDTH
    return "█" * int(full) + ("▌" if full - int(full) >= 0.5 else "")


def phase_table(state: RunState) -> Any:
    from rich.table import Table

    which = "whole run" if state.status == "ended" else "newest window"
    clock = f"{state.clock} clock" if state.clock else "clock unknown"
    table = Table(title=f"phases, mean ms ({which}; {clock})", title_justify="left", box=None, pad_edge=False)
    table.add_column("phase")
    table.add_column("ms", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    for phase, ms in state.phases.items():
        if phase.endswith(".comm_wait"):
            continue
        base = share_base(phase)
        of = state.phases.get(base) if base else None
        share = ms / of if of else None
        table.add_row(phase, f"{ms:.3f}", f"{100 * share:.1f}%" if share is not None else "",
                      _bar(share) if share is not None else "")
    return table


def rate_lines(state: RunState) -> list[str]:
    lines = []
    periods = [e["period_ms"] for e in state.trend if e.get("period_ms") is not None]
    if "period" in state.phases:
        lines.append(f"period   {state.phases['period']:.3f} ms  {trend(periods)}  {sparkline(periods[-24:])}")
    key = headline_rate(state.rates)
    if key is not None:
        values = [e[key] for e in state.trend if e.get(key) is not None]
        others = ", ".join(f"{format_rate(state.rates[k])} {RATES[k]}" for k in RATES if k != key and k in state.rates)
        lines.append(f"throughput  {format_rate(state.rates[key])} {RATES[key]}  {trend(values)}  "
                     f"{sparkline(values[-24:])}" + (f"  ({others})" if others else ""))
    if state.job_rates:
        lines.append("job (all ranks)  " + ", ".join(f"{format_rate(v)} {k.replace('_per_s', '')}/s"
                                                     for k, v in state.job_rates.items()))
    if state.mfu is not None:
        values = [e["mfu"] for e in state.trend if e.get("mfu") is not None]
        lines.append(f"MFU  {100 * state.mfu:.1f}%  {trend(values)}  {sparkline(values[-24:])}")
    return lines


def comm_memory_lines(state: RunState) -> list[str]:
    lines = []
    for phase, ms in state.comm.items():
        if phase.endswith(".comm_wait"):
            of = state.phases.get(phase.split(".")[0])
            lines.append(f"exposed comm  {phase} {ms:.3f} ms" + (f" ({100 * ms / of:.0f}% of it)" if of else ""))
    if "collectives_ms" in state.comm:
        hidden = state.comm.get("hidden_share")
        lines.append(f"collectives  {state.comm['collectives_ms']:.3f} ms a backward"
                     + (f", {100 * hidden:.0f}% hidden" if hidden is not None else ""))
    mem = state.memory
    if mem.get("peak_allocated") is not None:
        lines.append(f"memory  peak allocated {mem['peak_allocated']:.0f} MB"
                     + (f", reserved {mem['peak_reserved']:.0f} MB" if mem.get("peak_reserved") is not None else "")
                     + (f", device free {mem['device_free']:.0f} MB" if mem.get("device_free") is not None else ""))
    return lines


def rank_table(state: RunState) -> Any:
    from rich.table import Table

    n = f"{state.ranks_reporting} ranks" if state.ranks_reporting else "ranks"
    table = Table(title=f"across {n}: each rank's window mean, ms", title_justify="left", box=None, pad_edge=False)
    for col in ("phase", "min", "median", "max", "slowest rank"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase, stats in state.ranks.items():
        slow = stats.get("slowest_rank")
        table.add_row(phase, *(f"{stats[s]:.3f}" if s in stats else "" for s in ("min", "median", "max")),
                      str(int(slow)) if slow is not None else "")
    return table


def verdict_lines(state: RunState) -> list[str]:
    from rich.markup import escape

    v = state.verdict
    if not v:
        return []
    color = _SEVERITY.get(v.get("severity"), "white")
    so_far = "" if v.get("final") else " (so far)"
    lines = [f"verdict{so_far}: [bold {color}]{v['kind']}[/] ({v.get('severity')}): {escape(str(v.get('why')))}"]
    lines += [f"  next: {tip}" for tip in v.get("advice") or []]
    return lines


def own_cost_line(state: RunState) -> str | None:
    own = state.own_cost
    if not own or own.get("us_per_step") is None:
        return None
    share = own.get("share_of_period")
    return (f"phase-timer's own host time ≈{own['us_per_step']:.1f} µs/step"
            + (f" ({100 * share:.2f}% of period)" if share is not None else ""))


def frame(state: RunState) -> Any:
    """The whole frame, a ``rich`` renderable."""
    from rich.console import Group
    from rich.markup import escape
    from rich.text import Text

    head = (f"[bold]phase-timer watch[/] {escape(state.run_dir)}  {_STATUS.get(state.status, state.status)}"
            + (f"  step {state.step}" if state.step is not None else "")
            + (f", {state.windows} window{'s' if state.windows > 1 else ''}" if state.windows else ""))
    parts: list[Any] = [Text.from_markup(head)]
    if state.note:
        parts.append(Text(state.note, style="dim"))
    if state.phases:
        parts.append(phase_table(state))
    lines = rate_lines(state) + comm_memory_lines(state)
    if lines:
        parts.append(Text("\n".join(lines)))
    if state.ranks:
        parts.append(rank_table(state))
    parts += [Text.from_markup(escape(line) if not line.startswith("verdict") else line)
              for line in verdict_lines(state)]
    own = own_cost_line(state)
    if own:
        parts.append(Text(own, style="dim"))
    if state.source:
        parts.append(Text(f"from {state.source}", style="dim"))
    return Group(*parts)
