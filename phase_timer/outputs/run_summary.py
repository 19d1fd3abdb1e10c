"""The run summary file: ``phase_timer_summary.json``, written by rank zero at the end (also after an exception).

One JSON object, described by ``phase_timer/summary_schema.json`` (``docs/diagnosis.md``
explains each field).  Written atomically: a temporary file in the same directory, then
a rename, so a reader never sees half a file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import sys
from typing import TYPE_CHECKING, Any, Protocol

from phase_timer import files
from phase_timer.phases import HOST_PHASES, ordered, share_base

if TYPE_CHECKING:
    from phase_timer.timing.clock import Clock
    from phase_timer.diagnosis import Diagnosis, Signals
    from phase_timer.measure import Measure
    from phase_timer.distributed.ranks import RankExchange
    from phase_timer.timing.stats import RunTotals, WindowSeries


#: The summary file's ``syncs`` block where no census measure listens (a core made without one): what
#: ``measures.syncs.Syncs().summary()`` says before a census ran (``tests/measures/test_syncs.py`` holds the two equal).
NO_CENSUS: dict[str, Any] = {"census": "not run", "step": None, "count": 0, "other_threads": 0, "paused": 0, "sites": []}


class RunRecord(Protocol):
    """What the summary is built from: a run's totals, signals and context (``TimingCore`` has them all).

    A protocol, so that the writer reads these and needs nothing else of the core (nor imports it).
    """

    clock: Clock
    context: dict[str, Any]
    diagnosis: Diagnosis | None
    interrupted: bool
    ranks: RankExchange | None
    series: WindowSeries
    signals: Signals
    skipped: int
    totals: RunTotals
    untimed_reason: str | None
    measures: list[Measure]

    def own_cost(self) -> dict[str, Any] | None: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def window(self) -> int: ...


FILE_NAME = "phase_timer_summary.json"
SCHEMA = "phase-timer/run-summary"
SCHEMA_VERSION = 10


def build_summary(core: RunRecord) -> dict[str, Any]:
    """The file's content, from the core's totals, signals, diagnosis and the door's context."""
    ctx = dict(core.context)
    totals = core.totals
    measured = {m.key: m.summary() for m in getattr(core, "measures", ()) if m.key is not None}
    phases: dict[str, Any] = {}
    for p in ordered(list(totals.phases)):
        t = totals.phases[p]
        share = totals.share(p)
        phases[p] = {
            "clock": "host" if p in HOST_PHASES else core.clock.kind,
            "count": t.count, "total_ms": t.total, "mean_ms": t.mean, "p50_ms": t.quantile(50),
            "p90_ms": t.quantile(90), "p99_ms": t.quantile(99), "max_ms": t.max,
            "share": share, "share_of": share_base(p) if share is not None else None,
        }
    flight = core.signals.flight
    n_flight = sum(flight.values())
    ranks = core.ranks
    per_rank = None
    if ranks is not None and ranks.totals is not None:
        rt = ranks.totals
        per_rank = {
            "world_size": rt.world_size,
            "reported": sorted(rt.steps),
            "gone": sorted(getattr(ranks, "gone", ()) or ()),
            "per_rank": {str(r): {"steps": rt.steps[r],
                                  "mean_ms": {p: rt.mean(r, p) for p in ordered(list(rt.sums.get(r, {})))}}
                         for r in sorted(rt.steps)},
        }
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "interrupted": core.interrupted,
        "door": ctx.pop("door", None),
        "config": {**ctx.pop("config", {}), "window": core.window},  # the window in effect
        "environment": _environment(core, ctx),
        "steps": {"timed": totals.steps, "skipped": core.skipped, "warmup": core.warmup_steps,
                  "untimed_reason": core.untimed_reason},
        "phases": phases,
        "steps_in_flight": None if not n_flight else {
            "samples": n_flight,
            "histogram": {str(k): v for k, v in sorted(flight.items())},
            "mean": sum(k * v for k, v in flight.items()) / n_flight,
            "median": float(statistics.median(sorted(flight.elements()))),
            "tail_checked": core.signals.tail_checked,
            "tail_busy": core.signals.tail_busy,
        },
        "own_cost": core.own_cost(),
        "ranks": per_rank,
        "syncs": measured.get("syncs") or dict(NO_CENSUS, sites=[]),  # no census measure: "not run", as the schema asks
        "memory": measured.get("memory"),
        "oom": measured.get("oom"),  # null: no out-of-memory error (or no measure listening for one)
        "memory_snapshot": measured.get("memory_snapshot"),  # null: not asked
        "throughput": measured.get("throughput"),
        "flops": measured.get("flops"),
        "communication": measured.get("communication"),
        "modules": measured.get("modules"),
        "diagnosis": core.diagnosis.as_dict() if core.diagnosis is not None else None,
        "windows": {"steps_per_window": core.window, **core.series.as_dict()},
    }



def _environment(core: RunRecord, ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "clock": core.clock.kind,
        "device": ctx.pop("device_name", None),
        "world_size": core.ranks.world_size if core.ranks is not None else 1,
        "rank": core.ranks.rank if core.ranks is not None else 0,
        "precision": ctx.pop("precision", None),
        "lightning": None,
        "cpu_count": ctx.pop("cpu_count", None),
        "loader": ctx.pop("loader", None),
        "optimizers": ctx.pop("optimizers", None),
    }
    for name in ("lightning", "pytorch_lightning"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__version__", None):
            env["lightning"] = mod.__version__
            break
    return env


def write_summary(core: RunRecord, directory: str | os.PathLike[str], *, name: str | None = None) -> str:
    """Write the file atomically in ``directory`` (as ``name``, default :data:`FILE_NAME`; a local folder or an
    fsspec URL, ``phase_timer.files``); returns its path."""
    data = _finite(build_summary(core))
    text = _one_line_lists(json.dumps(data, indent=1, allow_nan=False, default=str)) + "\n"
    return files.write(files.join(directory, name or FILE_NAME), text.encode())


_SCALAR = r"(?:-?[0-9][0-9.eE+-]*|null|true|false)"
#: An indented list of numbers: a raw newline after each comma, which no JSON string holds.
_SCALAR_LIST = re.compile(rf"\[\n *({_SCALAR}(?:,\n *{_SCALAR})*)\n *\]")


def _one_line_lists(text: str) -> str:
    """Lists of numbers on one line each (the window columns), the rest indented."""
    return _SCALAR_LIST.sub(lambda m: "[" + ", ".join(re.split(r",\n *", m.group(1))) + "]", text)


def _finite(obj: Any) -> Any:
    """JSON has no NaN or infinity: such a value is written as null (unknown), never as a number."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def schema() -> dict[str, Any]:
    """The documented JSON Schema of the file."""
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "summary_schema.json")) as f:
        return json.load(f)
