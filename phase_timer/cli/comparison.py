"""``phase-timer compare``'s judgement of two sides: the rows, the gates, the verdicts and the warnings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phase_timer.cli.compare_rows import (
    MemoryRow,
    RateRow,
    Row,
    compare_phase,
    gated_rate,
    memory_exceeds,
    memory_rows,
    memory_value,
    number_at,
    throughput_rows,
)
from phase_timer.cli.compare_modules import ModuleRow, module_rows, module_verdict
from phase_timer.cli.compare_side import Side
from phase_timer.cli.errors import ReportError
from phase_timer.cli.rates import RATES, headline_rate
from phase_timer.phases import TOTALS, ordered, share_base
from phase_timer.distributed.rank_view import RankRow, compare_ranks, rank_verdicts
from phase_timer.outputs.run_summary import FILE_NAME


@dataclass
class Comparison:
    base: Side
    cand: Side
    metric: str
    rows: dict[str, Row]
    gated: list[str]
    fail_above: float | None
    warnings: list[str]
    failed: list[str]
    verdicts: list[str]
    #: The memory table (both sides with memory data), the memory gate's threshold and its outcome.
    memory: dict[str, MemoryRow] | None = None
    fail_above_memory: float | None = None
    memory_failed: bool = False
    #: The throughput table (both sides with throughput), the rate gated, the gate's threshold and its outcome.
    throughput: dict[str, RateRow] | None = None
    throughput_gated: str | None = None
    fail_below_throughput: float | None = None
    throughput_failed: bool = False
    #: Each phase's slowest rank on both sides (``rank_view``); None: a side ran in one process.
    ranks: list[RankRow] | None = None
    #: Which module changed (both sides' summary files with module rows); None: a side has none.
    modules: list[ModuleRow] | None = None


def parts_of(phase: str, rows: dict[str, Row]) -> list[str]:
    """The phases that make up a total: the step's phases for ``step``, everything in the period for ``period``."""
    if phase == "step":
        return [p for p in rows if share_base(p) == "step"]
    if phase == "period":
        return [p for p in rows if p not in TOTALS]
    return []


def verdict_line(phase: str, row: Row, rows: dict[str, Row], metric: str) -> str:
    """"step +7.9% slower (beyond noise ±1.2%): backward +12.4%, optimizer +0.3%"."""
    name = phase if metric == "mean" else f"{phase} {metric}"
    if row.delta_pct is None:
        return f"{name}: not comparable (a zero or missing baseline)"
    pct = f"{row.delta_pct:+.1f}%"
    if row.noise_pct is None:
        head = f"{name} {pct} {'slower' if row.delta_pct > 0 else 'faster'} (noise unknown: too few windows)"
    elif row.beyond_noise:
        head = f"{name} {pct} {'slower' if row.delta_pct > 0 else 'faster'} (beyond noise ±{row.noise_pct:.1f}%)"
    else:
        return f"{name} {pct}, within noise ±{row.noise_pct:.1f}%: no change beyond noise"
    parts = [rows[p] for p in parts_of(phase, rows) if rows[p].delta_pct is not None]
    if not parts:
        return head
    parts.sort(key=lambda r: -abs(r.delta_ms or 0.0))
    moved = [r for r in parts if r.beyond_noise is not False]
    if not moved:
        return head + ": no phase of it beyond its own noise"
    shown = ", ".join(f"{r.phase} {r.delta_pct:+.1f}% ({r.delta_ms:+.3f} ms)" for r in moved[:3])
    if len(moved) > 3:
        shown += f"; {len(moved) - 3} more beyond noise"
    return head + ": " + shown + ("; the rest within noise" if len(parts) > len(moved) else "")


def rate_verdict(row: RateRow) -> str:
    """"tokens/s -8.1% lower (beyond noise ±1.0%)", or within noise, or noise unknown."""
    delta = row.delta_pct
    if delta is None:
        return f"{row.what}: not comparable (a zero or missing baseline)"
    way = "lower" if delta < 0 else "higher"
    if row.noise_pct is None:
        return (f"{row.what} {delta:+.1f}% {way} (noise unknown: too few windows, or a count that varied from step "
                "to step with no TensorBoard windows beside the file)")
    if row.beyond_noise:
        return f"{row.what} {delta:+.1f}% {way} (beyond noise ±{row.noise_pct:.1f}%)"
    return f"{row.what} {delta:+.1f}%, within noise ±{row.noise_pct:.1f}%: no change beyond noise"


def comparability(base: Side, cand: Side, phases_b: set[str], phases_c: set[str]) -> list[str]:
    """What makes the two runs hard to compare (warnings)."""
    out = []
    for side in (base, cand):
        if side.source != "summary":
            what = "per-step values" if side.source == "per-step" else "window summaries"
            out.append(f"{side.path}: no {FILE_NAME}; its numbers come from the TensorBoard {what}")
        elif side.batches_from:
            out.append(f"{side.path}: noise band from {side.batches_from}")
        if side.interrupted:
            out.append(f"{side.path}: the run was interrupted; its numbers cover the steps before that")
    eb, ec = base.environment or {}, cand.environment or {}
    checks = (("device", "device"), ("torch", "torch version"), ("world_size", "world size"),
              ("precision", "precision"), ("cuda", "CUDA version"))
    for key, label in checks:
        if eb and ec and eb.get(key) != ec.get(key):
            out.append(f"different {label}: baseline {eb.get(key)!r}, candidate {ec.get(key)!r}")
    bb, bc = ((e.get("loader") or {}).get("batch_size") for e in (eb, ec))
    if bb is not None and bc is not None and bb != bc:
        out.append(f"different batch size: baseline {bb}, candidate {bc}")
    if base.door and cand.door and base.door != cand.door:
        out.append(f"different doors: baseline {base.door}, candidate {cand.door} (their boundaries differ slightly)")
    if phases_b != phases_c:
        only_b, only_c = sorted(phases_b - phases_c), sorted(phases_c - phases_b)
        what = "; ".join(s for s in (f"only the baseline has {', '.join(only_b)}" if only_b else "",
                                     f"only the candidate has {', '.join(only_c)}" if only_c else "") if s)
        out.append(f"different phases: {what}")
    if base.source != cand.source and "summary" in (base.source, cand.source):
        out.append("one side from its summary file, the other from TensorBoard: p50 and p90 are estimated differently")
    mem = [memory_value(s.memory, "peak_allocated") is not None for s in (base, cand)]
    if mem[0] != mem[1]:
        without = cand if mem[0] else base
        out.append(f"{without.path}: no memory data; memory is compared only when both sides have it")
    return out + _throughput_warnings(base, cand)


def _throughput_warnings(base: Side, cand: Side) -> list[str]:
    """What makes the two runs' rates and MFU hard to compare."""
    if bool(base.throughput) != bool(cand.throughput):
        without = cand if base.throughput else base
        return [f"{without.path}: no throughput (no batch was counted); throughput is compared only when both "
                "sides have it"]
    if not base.throughput:
        return []
    out = []
    heads = [headline_rate(s.throughput) for s in (base, cand)]
    if heads[0] != heads[1]:
        which = "baseline" if heads[0] == "tokens_per_s" else "candidate"
        out.append(f"only the {which} counts tokens: samples/s is the throughput compared")
    fb, fc = (number_at(s.flops, "per_step", "model") for s in (base, cand))
    if fb and fc and abs(fc - fb) > 0.01 * fb:
        out.append(f"different FLOPs a step: baseline {fb:.4g}, candidate {fc:.4g} (another model or batch): their "
                   "rates and MFU measure unlike steps")
    pb, pc = ((s.flops or {}).get("peak") for s in (base, cand))
    if pb and pc and (pb.get("tflops"), pb.get("precision")) != (pc.get("tflops"), pc.get("precision")):
        out.append(f"different MFU peaks: baseline {pb.get('tflops'):g} TFLOP/s {pb.get('precision') or ''}, "
                   f"candidate {pc.get('tflops'):g} TFLOP/s {pc.get('precision') or ''}".rstrip())
    return out


def _require_memory(side: Side) -> None:
    if memory_value(side.memory, "peak_allocated") is None:
        raise ReportError(f"{side.path}: no memory data for --fail-above-memory (memory is read on CUDA only: "
                          "not on a CPU or the host clock, nor with memory=False)")


def _require_throughput(side: Side) -> None:
    if not side.throughput:
        raise ReportError(f"{side.path}: no throughput for --fail-below-throughput (no batch was counted: pass "
                          "samples_per_batch= or tokens_per_batch=, or a run from before phase-timer counted them)")


def compare(base: Side, cand: Side, *, metric: str = "mean", gated: Sequence[str] = ("step",),
            fail_above: float | None = None, fail_above_memory: float | None = None,
            fail_below_throughput: float | None = None) -> Comparison:
    """The two sides compared: every phase's row, the memory and throughput tables, each gate's outcome, the
    verdicts and the warnings.  A gate on data a side lacks, or runs on different clocks, is bad input."""
    if fail_above_memory is not None:  # a gate on data one side lacks is bad input, not a pass
        _require_memory(base)
        _require_memory(cand)
    if fail_below_throughput is not None:
        _require_throughput(base)
        _require_throughput(cand)
    if base.clock and cand.clock and base.clock != cand.clock:
        raise ReportError(f"the baseline was timed on the {base.clock} clock and the candidate on the {cand.clock} "
                           "clock: their phases do not measure the same thing")
    pb, pc = set(base.values), set(cand.values)
    for phase in gated:
        for side, have in ((base, pb), (cand, pc)):
            if phase not in have:
                raise ReportError(f"phase {phase!r} is not in {side.path} (it has: {', '.join(ordered(list(have)))})")
    rows = {p: compare_phase(p, base, cand, metric) for p in ordered(list(pb | pc))}
    failed = []
    if fail_above is not None:
        for phase in gated:
            r = rows[phase]
            if r.delta_pct is not None and r.delta_pct > fail_above and r.beyond_noise is not False:
                failed.append(phase)
    memory = memory_rows(base, cand)
    memory_failed = fail_above_memory is not None and memory is not None and memory_exceeds(
        memory["peak_allocated"], fail_above_memory)
    verdicts = [verdict_line(p, rows[p], rows, metric) for p in gated]
    rates = throughput_rows(base, cand)
    rate_name = gated_rate(base, cand) if rates is not None else None
    rate_row = rates.get(RATES[rate_name]) if rates is not None and rate_name else None
    if rate_row is not None:
        verdicts.append(rate_verdict(rate_row))
    rate_failed = (fail_below_throughput is not None and rate_row is not None and rate_row.delta_pct is not None
                   and rate_row.delta_pct < -fail_below_throughput and rate_row.beyond_noise is not False)
    ranks = compare_ranks(base.ranks, cand.ranks)
    verdicts += rank_verdicts(ranks)
    mods = module_rows(base.modules, cand.modules)
    said = module_verdict(mods, (base.modules or {}).get("samples", 0), (cand.modules or {}).get("samples", 0))
    if said is not None:
        verdicts.append(said)
    return Comparison(base, cand, metric, rows, list(gated), fail_above, comparability(base, cand, pb, pc), failed,
                      verdicts, memory, fail_above_memory, memory_failed, rates, rate_name, fail_below_throughput,
                      rate_failed, ranks, mods)
