"""What ``phase-timer watch`` shows of a run, read from what the run writes: one :class:`RunState` a frame.

Three files, in the order they are preferred:

- ``phase_timer_live.json`` (:mod:`phase_timer.outputs.live`): rank zero's newest window, the trend, the
  verdict so far and the own cost, rewritten each window;
- ``phase_timer_summary.json``: once the run has ended, the whole run's figures and its verdict;
- the TensorBoard event files (:func:`~phase_timer.cli.read.read_phase_scalars`): the newest window's
  scalars, for a run that writes no live file.

Nothing here touches the training process; a file read half-way through a rename is read again at the
next frame.  Problems with the directory itself are :class:`~phase_timer.cli.errors.ReportError`.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from phase_timer.cli.errors import ReportError
from phase_timer.outputs.live import LIVE_NAME, LIVE_SCHEMA
from phase_timer.outputs.run_summary import FILE_NAME
from phase_timer.outputs.tags import MEMORY_PREFIX, RANKS_PREFIX, RANKS_TAG, WINDOW_PREFIX
from phase_timer.phases import ordered

#: Where runs are looked for under the current directory (Lightning's, phase-timer's own, a 🤗 output_dir's).
RUN_GLOBS = ("lightning_logs/*", "phase-timer-logs/*", "*/lightning_logs/*", "*/phase-timer-logs/*", "runs/*",
             "*/runs/*", "*/*/lightning_logs/*")
_RATES = ("tokens_per_s", "samples_per_s", "steps_per_s")


@dataclass
class RunState:
    """One frame's worth of a run.  ``status``: ``waiting`` (no window yet), ``running``, ``ended``, ``gone``."""

    run_dir: str
    status: str
    source: str = ""
    step: int | None = None
    windows: int = 0
    clock: str | None = None
    #: Mean ms per phase: the newest window's while running, the whole run's once ended.
    phases: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    job_rates: dict[str, float] = field(default_factory=dict)
    mfu: float | None = None
    #: Per window, oldest first: (step, period ms, headline rate, mfu).
    trend: list[dict[str, float]] = field(default_factory=list)
    comm: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    #: phase -> {min, median, max, slowest_rank}, and the ranks reporting.
    ranks: dict[str, dict[str, float]] = field(default_factory=dict)
    ranks_reporting: int | None = None
    verdict: dict[str, Any] | None = None
    own_cost: dict[str, Any] | None = None
    note: str | None = None


def newest_run(root: str = ".") -> str:
    """The run directory under ``root``'s usual places whose files changed last."""
    best, best_t = None, -1.0
    for pattern in RUN_GLOBS:
        for d in glob.glob(os.path.join(root, pattern)):
            t = _last_change(d)
            if t is not None and t > best_t:
                best, best_t = d, t
    if best is None:
        raise ReportError(f"{os.path.abspath(root)}: no run found under {', '.join(p.split('/')[0] + '/' for p in RUN_GLOBS[:3])} "
                          "or a 🤗 output_dir's runs/: name the run's directory (phase-timer watch LOG_DIR)")
    return os.path.normpath(best)


def _last_change(run_dir: str) -> float | None:
    """The newest modification time of phase-timer's files or event files directly in ``run_dir`` (None: none)."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return None
    times = [os.path.getmtime(os.path.join(run_dir, n)) for n in names
             if n in (LIVE_NAME, FILE_NAME) or n.startswith("events.out.tfevents.")]
    return max(times) if times else None


def check_log_dir(path: str) -> str:
    """``path`` as a run directory to watch: it must exist and be a directory."""
    if not os.path.exists(path):
        raise ReportError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise ReportError(f"{path}: not a directory (phase-timer watch takes a run's log directory)")
    return path


def _json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_state(run_dir: str) -> RunState:
    """What the run's files say now."""
    if not os.path.isdir(run_dir):
        return RunState(run_dir, "gone", note=f"{run_dir} is gone (deleted under the watch); the last frame stays")
    live = _json(os.path.join(run_dir, LIVE_NAME))
    summary = _json(os.path.join(run_dir, FILE_NAME))
    if live is not None and live.get("schema") == LIVE_SCHEMA:
        state = from_live(run_dir, live)
        if summary is not None and state.status == "ended":
            add_summary(state, summary)
        return state
    if summary is not None:
        state = RunState(run_dir, "ended", source=FILE_NAME)
        add_summary(state, summary)
        return state
    return from_events(run_dir)


def _split_scalars(state: RunState, scalars: dict[str, float]) -> None:
    """A window's scalars as the frame's: phase means, rates, MFU, comm, memory, ranks."""
    head = WINDOW_PREFIX + "/"
    for tag, v in scalars.items():
        if tag.startswith(head) and tag.endswith("_ms/mean"):
            state.phases[tag[len(head):-len("_ms/mean")]] = v
        elif tag.startswith("throughput/"):
            name = tag[len("throughput/"):]
            if name in _RATES:
                state.rates[name] = v
            elif name.startswith("job_"):
                state.job_rates[name[4:]] = v
            elif name == "mfu":
                state.mfu = v
        elif tag.startswith("comm/"):
            state.comm[tag[len("comm/"):]] = v
        elif tag.startswith(MEMORY_PREFIX + "/") and tag.endswith("_mb"):
            state.memory[tag[len(MEMORY_PREFIX) + 1:-3]] = v
        elif tag.startswith(RANKS_PREFIX + "/"):
            phase, _, stat = tag[len(RANKS_PREFIX) + 1:].rpartition("_ms/")
            state.ranks.setdefault(phase, {})[stat] = v
        elif tag == RANKS_TAG:
            state.ranks_reporting = int(v)
    state.comm.update({p: ms for p, ms in state.phases.items() if p.endswith(".comm_wait")})


def from_live(run_dir: str, live: dict[str, Any]) -> RunState:
    windows = int(live.get("windows") or 0)
    status = live.get("status") or "running"
    state = RunState(run_dir, status if windows or status == "ended" else "waiting", source=LIVE_NAME,
                     step=live.get("step"), windows=windows, clock=live.get("clock"))
    _split_scalars(state, live.get("scalars") or {})
    state.phases = {p: state.phases[p] for p in ordered(list(state.phases))}
    state.trend = list(live.get("history") or [])
    state.verdict = live.get("verdict")
    state.own_cost = live.get("own_cost")
    return state


def add_summary(state: RunState, data: dict[str, Any]) -> None:
    """An ended run's own figures: the whole run's phase means, rates, MFU, verdict and own cost."""
    phases = data.get("phases") or {}
    state.phases = {p: phases[p]["mean_ms"] for p in ordered(list(phases)) if phases[p].get("mean_ms") is not None}
    state.source = FILE_NAME if state.source != LIVE_NAME else f"{FILE_NAME} (+ {LIVE_NAME})"
    state.clock = (data.get("environment") or {}).get("clock") or state.clock
    state.step = state.step if state.step is not None else (data.get("steps") or {}).get("timed")
    thr = data.get("throughput") or {}
    state.rates = {k: thr[k] for k in _RATES if thr.get(k) is not None} or state.rates
    state.job_rates = {k: v for k, v in (thr.get("job") or {}).items() if v is not None} or state.job_rates
    mfu = ((data.get("flops") or {}).get("mfu") or {}).get("step")
    state.mfu = mfu if mfu is not None else state.mfu
    diag = data.get("diagnosis")
    if diag:
        state.verdict = {"kind": diag["kind"], "severity": diag["severity"], "why": diag["why"],
                         "advice": list(diag.get("next") or [])[:1], "final": True}
    if data.get("own_cost"):
        state.own_cost = data["own_cost"]
    if not state.trend:
        windows = data.get("windows") or {}
        period = ((windows.get("phases") or {}).get("period") or {}).get("mean_ms") or []
        state.trend = [{"step": s, "period_ms": p} for s, p in zip(windows.get("last_step") or [], period)]
        state.windows = state.windows or len(period)
    state.status = "ended"


def from_events(run_dir: str) -> RunState:
    """The newest window of the run's TensorBoard scalars (a run that writes no live file)."""
    from phase_timer.cli.read import read_phase_scalars

    try:
        files = [n for n in os.listdir(run_dir) if n.startswith("events.out.tfevents.")]
    except OSError:
        files = []
    if not files:
        return RunState(run_dir, "waiting", note=f"no {LIVE_NAME}, {FILE_NAME} nor event files yet")
    scalars = read_phase_scalars(run_dir)
    state = RunState(run_dir, "running" if not scalars.empty else "waiting", source="TensorBoard event files")
    last = {}
    for phase, stats in scalars.window.items():
        if stats.get("mean"):
            last[f"{WINDOW_PREFIX}/{phase}_ms/mean"] = stats["mean"][-1][1]
    for name, pts in scalars.throughput.items():
        last[f"throughput/{name}"] = pts[-1][1]
    _split_scalars(state, last)
    state.phases = {p: state.phases[p] for p in ordered(list(state.phases))}
    period = dict((scalars.window.get("period") or {}).get("mean") or [])
    state.trend = [{"step": s, "period_ms": v} for s, v in sorted(period.items())]
    state.windows = len(state.trend)
    state.step = state.trend[-1]["step"] if state.trend else None
    state.note = f"no {LIVE_NAME}: the event files' newest window (a logger may hold the newest back)"
    return state
