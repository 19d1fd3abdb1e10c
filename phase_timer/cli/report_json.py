"""``phase-timer report --json``: the runs as one JSON document (its schema is in :mod:`phase_timer.cli.report`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from phase_timer.cli.report_runs import RunReport

_STAT_KEYS = ("mean_ms", "p50_ms", "p90_ms", "max_ms")
#: What ``--json`` copies from a run summary file as it is there.
_SUMMARY_KEYS = ("interrupted", "steps_in_flight", "own_cost", "diagnosis")


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def to_json(reports: Sequence[RunReport]) -> dict[str, Any]:
    """The ``--json`` document (its schema is in :mod:`phase_timer.cli.report`'s docstring)."""
    runs = []
    for r in reports:
        keys = _STAT_KEYS + (("p99_ms",) if r.source == "summary" else ())
        phases = {p: {**{k: _finite(getattr(s, k)) for k in keys}, "share": _finite(s.share)} for p, s in r.phases.items()}
        run = {
            "run": r.run,
            "source": r.source,
            "steps": r.steps,
            "windows": r.windows,
            "skipped_steps": r.skipped_steps,
            "phases": phases,
        }
        if r.summary is not None:
            run.update({k: r.summary.get(k) for k in _SUMMARY_KEYS})
            run["clock"] = r.clock
        run["memory"] = r.memory
        run["throughput"] = r.throughput
        run["flops"] = r.flops
        run["modules"] = r.summary.get("modules") if r.summary is not None else None
        runs.append(run)
    return {"runs": runs}
