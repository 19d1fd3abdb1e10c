"""A run's verdict and its files: at the end (the verdict, its text to the sinks, the summary file, the trace), and
so far (what the live file shows while the run goes on).  Each reads the core (``run/core.py``'s ``TimingCore``)
and its measures, never changes what it times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from phase_timer._env import warn
from phase_timer.diagnosis import format_verdict
from phase_timer.outputs.sinks import Sink
from phase_timer.outputs.tags import DIAGNOSIS_TAG
from phase_timer.outputs.trace import TraceWriter

log = logging.getLogger(__name__)


def conclude(core: Any, sinks: Sequence[Sink], last_step: int) -> None:
    """The verdict: once to the sinks as text (at ``last_step``), and (rank zero) the run summary file.  Never
    raises."""
    advice: list[str] = []
    for measure in core.measures:  # their last figures (the snapshot's end, the ranks' out-of-memory errors); MFU's lines
        try:
            advice += measure.end(core.totals)
        except Exception as err:  # noqa: BLE001 - a measure is an extra: the verdict and the files go on
            warn(log, f"phase-timer: {type(measure).__name__} failed at the run's end ({type(err).__name__}: {err})")
    try:
        core.diagnosis = core.verdict(mfu=advice)
    except Exception as err:  # noqa: BLE001 - a bug in a rule must not cost the run its numbers
        warn(log, f"phase-timer: could not diagnose the run ({type(err).__name__}: {err})")
        return
    if core.totals.steps or core.oom is not None:
        text = format_verdict(core.diagnosis).replace("\n", "  \n")  # markdown line breaks
        for sink in sinks:  # every one is guarded (finish): a sink without text is skipped there
            sink.write_text(DIAGNOSIS_TAG, text, last_step)
    # Rank zero's file; and a rank given a file of its own writes it (one that ran out of memory: summary_dir and
    # summary_name set by oom.caught).
    if core.summary_dir is not None and (core.ranks is None or core.ranks.rank == 0 or core.summary_name is not None):
        from phase_timer.outputs.run_summary import write_summary

        try:
            core.summary_path = write_summary(core, core.summary_dir, name=core.summary_name)
        except Exception as err:  # noqa: BLE001 - e.g. a full disk: the printed summary still says it all
            warn(log, f"phase-timer: could not write the run summary file ({type(err).__name__}: {err})")


def live_view(core: Any) -> dict:
    """What the live file adds to the scalars: the verdict so far (the run's, once it has one) and the own cost.

    Called on the live file's writer thread, never the training thread, while the run changes what it
    reads: a value may be a window behind, and a read that meets a change in progress raises (the live
    file then goes without these, that once).  The verdict so far leaves out MFU's tips (counting them is
    the end's work)."""
    out: dict = {"clock": core.clock.kind, "steps_timed": core.totals.steps, "skipped_steps": core.skipped}
    diagnosis = core.diagnosis
    if diagnosis is None and core.totals.steps:
        diagnosis = core.verdict()
    if diagnosis is not None:
        out["verdict"] = {"kind": diagnosis.kind, "severity": diagnosis.severity, "why": diagnosis.why,
                          "advice": list(diagnosis.next[:1]), "final": core.diagnosis is not None}
    own = core.own_cost()
    if own is not None:
        out["own_cost"] = {"us_per_step": own["us_per_step"], "share_of_period": own.get("share_of_period")}
    return out


def finished_now(engine: Any) -> list[tuple] | None:
    """What the device has finished, without waiting for it: a few polls (the resolver thread's share
    included), at most ~0.1 s of host time, never a device wait."""
    out: list[tuple] = []
    for _ in range(64):
        # The newest step done (one query; always on the host clock), or none left: nothing to wait for.
        if engine.newest_done() is not False:
            out.extend(engine.drain() or ())
            break
        out.extend(engine.poll() or ())
        time.sleep(0.002)
    return out or None


def write_trace(trace: TraceWriter | None) -> None:
    """The trace file, where steps were traced (a failure warns)."""
    if trace is None or trace.ref is None:
        return
    try:
        path = trace.write()
        log.info("phase-timer: trace of steps %d..%d in %s", trace.first, trace.stop - 1, path)
    except OSError as err:
        msg = f"phase-timer: could not write the trace ({err})"
        warn(log, msg, 3)
