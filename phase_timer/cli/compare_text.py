"""``phase-timer compare``'s text: the sides, the phase table, the memory and throughput tables, the gates' lines."""

from __future__ import annotations

from phase_timer.cli.compare_rows import MEMORY_ROWS, MemoryRow, RateRow
from phase_timer.cli.compare_modules import format_module_table
from phase_timer.cli.compare_side import Side
from phase_timer.cli.comparison import Comparison
from phase_timer.cli.rates import RATES, format_rate
from phase_timer.distributed.rank_view import format_rank_comparison
from phase_timer.outputs.run_summary import FILE_NAME

_NO_BAND = "no noise band: the allocator's counters are deterministic in a steady loop"


def _num(v: float | None, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def format_comparison(c: Comparison) -> str:
    from tabulate import tabulate

    rows = []
    for r in c.rows.values():
        mark = "" if r.beyond_noise is None else ("slower" if r.delta_ms > 0 else "faster") if r.beyond_noise else "~"
        rows.append((r.phase, _num(r.baseline_ms, ".3f"), _num(r.candidate_ms, ".3f"), _num(r.delta_ms, "+.3f"),
                     _num(r.delta_pct, "+.1f"), "" if r.noise_pct is None else f"±{r.noise_pct:.1f}", mark))
    heads = ("phase", f"baseline {c.metric} ms", f"candidate {c.metric} ms", "delta ms", "delta %", "noise %",
             "verdict")
    table = tabulate(rows, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 5 + ("left",))
    lines = [f"baseline:  {_describe(c.base)}", f"candidate: {_describe(c.cand)}", table,
             "noise: the band of the difference, 3 standard errors from each run's window-to-window spread "
             "(~ within noise; blank: too few windows)"]
    if c.memory is not None:
        lines.append(format_memory_table(c.memory))
    if c.throughput is not None:
        lines.append(format_throughput_table(c.throughput))
    if c.ranks:
        lines.append(format_rank_comparison(c.ranks))
    if c.modules:
        lines.append(format_module_table(c.modules))
    lines += c.verdicts
    for name, side in (("baseline", c.base), ("candidate", c.cand)):
        lines += [f"the {name} changed partway through its run: {why} (its figures mix both levels)" for why in side.changed]
    if c.fail_above is not None:
        lines.append(_gate_line(c))
    if c.fail_above_memory is not None:
        lines.append(_memory_gate_line(c))
    if c.fail_below_throughput is not None:
        lines.append(_throughput_gate_line(c))
    return "\n".join(lines)


def _rate(label: str, v: float | None) -> str:
    if v is None:
        return ""
    return f"{100 * v:.1f}%" if label.startswith("MFU") else format_rate(v)


def format_throughput_table(rows: dict[str, RateRow]) -> str:
    from tabulate import tabulate

    body = []
    for label, r in rows.items():
        way = "lower" if (r.delta_pct or 0.0) < 0 else "higher"
        mark = "" if r.beyond_noise is None else way if r.beyond_noise else "~"
        body.append((label, _rate(label, r.baseline), _rate(label, r.candidate), _num(r.delta_pct, "+.1f"),
                     "" if r.noise_pct is None else f"±{r.noise_pct:.1f}", mark))
    heads = ("throughput", "baseline", "candidate", "delta %", "noise %", "")
    return tabulate(body, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 4 + ("left",))


def _throughput_gate_line(c: Comparison) -> str:
    assert c.throughput is not None and c.throughput_gated is not None  # compare() raised otherwise
    row = c.throughput[RATES[c.throughput_gated]]
    if c.throughput_failed:
        return f"FAIL: {row.what} lower by more than {c.fail_below_throughput:g}% and beyond noise"
    note = " (noise unknown, gated on the threshold alone)" if row.noise_pct is None else ""
    return f"pass: {row.what} not lower by more than {c.fail_below_throughput:g}% beyond noise{note}"


def format_memory_table(rows: dict[str, MemoryRow]) -> str:
    from tabulate import tabulate

    body = [(MEMORY_ROWS[r.what], _num(r.baseline_mb, ".1f"), _num(r.candidate_mb, ".1f"), _num(r.delta_mb, "+.1f"),
             _num(r.delta_pct, "+.1f")) for r in rows.values()]
    heads = ("memory", "baseline MiB", "candidate MiB", "delta MiB", "delta %")
    return tabulate(body, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 4)


def _memory_gate_line(c: Comparison) -> str:
    assert c.memory is not None  # the gate needs both sides' memory: compare() raised otherwise
    row = c.memory["peak_allocated"]
    change = f"{row.delta_pct:+.1f}%" if row.delta_pct is not None else f"{row.delta_mb:+.1f} MiB"
    what = f"peak allocated {change} ({row.baseline_mb:.1f} -> {row.candidate_mb:.1f} MiB)"
    if c.memory_failed:
        return f"FAIL: {what}, more than {c.fail_above_memory:g}% ({_NO_BAND})"
    return f"pass: {what}, not more than {c.fail_above_memory:g}% ({_NO_BAND})"


def _describe(side: Side) -> str:
    what = {"summary": FILE_NAME, "per-step": "TensorBoard per-step values", "windows": "TensorBoard windows"}[side.source]
    steps = f"{side.steps} steps" if side.steps else "steps unknown"
    return f"{side.path} ({what}, {steps})"


def _gate_line(c: Comparison) -> str:
    if c.failed:
        names = ", ".join(p if c.metric == "mean" else f"{p} {c.metric}" for p in c.failed)
        return f"FAIL: {names} slower by more than {c.fail_above:g}% and beyond noise"
    unknown = [p for p in c.gated if c.rows[p].noise_pct is None]
    note = f" ({', '.join(unknown)}: noise unknown, gated on the threshold alone)" if unknown else ""
    return f"pass: no gated phase ({', '.join(c.gated)}) slower by more than {c.fail_above:g}% beyond noise{note}"
