"""``phase-timer compare --json``: the comparison as one JSON document."""

from __future__ import annotations

from typing import Any

from phase_timer.cli.compare_side import Side
from phase_timer.cli.compare_modules import modules_json
from phase_timer.cli.comparison import Comparison


def to_json(c: Comparison) -> dict[str, Any]:
    def side(s: Side) -> dict[str, Any]:
        return {"path": s.path, "source": s.source, "steps": s.steps, "clock": s.clock}

    return {
        "metric": c.metric,
        "baseline": side(c.base),
        "candidate": side(c.cand),
        "phases": {p: {"baseline_ms": r.baseline_ms, "candidate_ms": r.candidate_ms, "delta_ms": r.delta_ms,
                       "delta_pct": r.delta_pct, "noise_pct": r.noise_pct, "beyond_noise": r.beyond_noise}
                   for p, r in c.rows.items()},
        "gate": {"phases": c.gated, "fail_above_pct": c.fail_above, "failed": c.failed,
                 "fail_above_memory_pct": c.fail_above_memory, "memory_failed": c.memory_failed,
                 "throughput": c.throughput_gated, "fail_below_throughput_pct": c.fail_below_throughput,
                 "throughput_failed": c.throughput_failed},
        "memory": None if c.memory is None else {
            w: {"baseline_mb": r.baseline_mb, "candidate_mb": r.candidate_mb, "delta_mb": r.delta_mb,
                "delta_pct": r.delta_pct} for w, r in c.memory.items()},
        "throughput": None if c.throughput is None else {
            label: {"baseline": r.baseline, "candidate": r.candidate, "delta_pct": r.delta_pct,
                    "noise_pct": r.noise_pct, "beyond_noise": r.beyond_noise} for label, r in c.throughput.items()},
        "verdicts": c.verdicts,
        "changed": {"baseline": c.base.changed, "candidate": c.cand.changed},
        "ranks": None if c.ranks is None else {
            r.phase: {"baseline_ms": r.base_ms, "baseline_rank": r.base_rank, "candidate_ms": r.cand_ms,
                      "candidate_rank": r.cand_rank, "delta_pct": r.delta_pct, "rank0_delta_pct": r.zero_pct}
            for r in c.ranks},
        "modules": modules_json(c.modules),
        "warnings": c.warnings,
    }
