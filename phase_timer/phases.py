"""The vocabulary of what is measured: the phases, their order, what is part of what, what each share is of.

Everything takes its names from here (the C engine through ``engine.native_steps``); it imports nothing of
phase-timer's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: The device time from a step's end (its last optimizer step) to the next batch's fetch.
BETWEEN = "between_steps"
#: The label of spans that are nobody's time, never reported, and out of ``period``: evaluation and validation
#: inside a record.
PAUSED = "paused"
#: The label of the span of an accumulated step's fetch of its next micro-batch: no device phase's and not the
#: step's (the host's ``data_wait`` has it), but the period's.
FETCH = "data_wait"
#: Built-in phases inside a step.  After the step's end they fold into ``between_steps``.
STEP_PHASES = ("h2d", "forward", "backward", "optimizer", "idle")
H2D, FORWARD, BACKWARD, OPTIMIZER, IDLE = STEP_PHASES
#: Built-in phases in display order.  Custom phases (plain-PyTorch door) go after them.
PHASE_ORDER = ("data_wait", "sync_wait", *STEP_PHASES, BETWEEN)
#: Phases read on the host clock whatever the device.  (``period`` is on the marks' clock where a record follows
#: the one before it: ``resolver.resolve``.)
HOST_PHASES = frozenset({"data_wait", "sync_wait"})
#: Totals, shown last.
TOTALS = ("step", "period")
#: A custom phase's time after the step's end is named apart: ``between_steps.<name>``.  So a name says
#: whether its time is part of ``step`` (``clip``) or of the time between steps (``between_steps.ema``),
#: and each share is of the right total, in the run's own table as in a report read back from TensorBoard
#: alone.  An in-step phase keeps the user's name (its tag is the one the README shows); a user's name is an
#: identifier, so it never holds the dot, and no user phase can take a name made here.
BETWEEN_PREFIX = BETWEEN + "."
#: Names that are no custom phase: they keep their name after the step's end.
_NOT_CUSTOM = frozenset({BETWEEN, PAUSED, FETCH, *HOST_PHASES, *TOTALS})
#: Exposed communication: the part of a phase the compute stream spent waiting for collectives it could not
#: hide (DDP's all-reduce tail in ``backward``; FSDP2's all-gather waits in ``forward`` and ``backward``, its
#: reduce-scatter tail).  A span labelled ``<phase>.comm_wait`` is ``<phase>``'s time *and* its own row ("of
#: which"): the phases still add up to ``step``, and no share sums it twice (:func:`part_of`).
COMM_WAIT = "comm_wait"
COMM_PARTS = {f"{p}.{COMM_WAIT}": p for p in ("forward", "backward")}
#: Phases in which a rank waits for the others (a slow rank shows there on every other rank): never a rank's
#: own lag.
RANK_WAITS = frozenset({"backward", "sync_wait", *COMM_PARTS})


def comm_label(phase: str) -> str:
    """The label of ``phase``'s wait for collectives (``backward`` -> ``backward.comm_wait``)."""
    return f"{phase}.{COMM_WAIT}"


def part_of(phase: str) -> str | None:
    """The phase whose time ``phase`` is part of ("of which": ``backward.comm_wait`` -> ``backward``), or None.

    Both engines apply it: a span so labelled inside the step counts to its own row and to the whole's."""
    return COMM_PARTS.get(phase)


def after_end(phase: str) -> str:
    """The name of a span of ``phase`` after the step's end (between steps).

    Built-in step phases fold into ``between_steps``; a custom phase becomes ``between_steps.<phase>`` (one
    used both inside the step and after it, e.g. left open across ``optimizer.step()``, is two rows, each
    of its own total); anything else keeps its name.  Both engines apply this one rule: the Python one at
    each span, the C one once per name (``engine.native_steps``).
    """
    if phase in STEP_PHASES or phase in COMM_PARTS:
        return BETWEEN
    if phase in _NOT_CUSTOM or phase.startswith(BETWEEN_PREFIX):
        return phase
    return BETWEEN_PREFIX + phase


def share_base(phase: str) -> str | None:
    """What a phase's share is of: the step's phases (built-in and custom) of ``step``; the rest of ``period``.

    ``period`` is the time per step, and ``step`` the part of it from the batch in hand to the step's end;
    a custom phase inside the step is part of ``step``, one between steps (``between_steps.<name>``) is not.
    """
    if phase in TOTALS:
        return None
    if phase in STEP_PHASES or phase in COMM_PARTS or _in_step_custom(phase):
        return "step"
    return "period"


def _in_step_custom(phase: str) -> bool:
    return (phase not in PHASE_ORDER and phase not in _NOT_CUSTOM and not phase.startswith(BETWEEN_PREFIX)
            and phase not in COMM_PARTS)


def whole_phases(phases: Iterable[str]) -> list[str]:
    """``phases`` without the parts of another ("of which" rows): what adds up, what a share sum or a stack takes."""
    return [p for p in phases if p not in COMM_PARTS]


def ordered(phases: set[str] | list[str] | dict[str, Any]) -> list[str]:
    """The step's phases (built-ins in their order, then custom ones alphabetically), then the time between
    steps (``between_steps``, then custom phases after the step's end), then the totals; ``data_wait`` and
    ``sync_wait`` first."""
    present = set(phases)
    custom = sorted(present - set(PHASE_ORDER) - set(TOTALS) - set(COMM_PARTS))
    inside = [q for p in PHASE_ORDER if p in present and p != BETWEEN
              for q in (p, comm_label(p)) if q in present]  # a phase's "of which" row right under it
    inside += [p for p in custom if share_base(p) == "step"]
    between = [BETWEEN] if BETWEEN in present else []
    after = [p for p in custom if share_base(p) != "step"]
    return inside + between + after + [p for p in TOTALS if p in present]


#: The name under which a rank on a device clock sends, with its window reports, its ``data_wait``'s part that
#: reached its device (ms over the window's steps, :func:`exposed_wait`): rank zero's RANK_STRAGGLER reads each rank's.
EXPOSED_WAIT = "data_wait_exposed_ms"


def exposed_wait(sums: dict[str, float], counts: dict[str, int], steps: int) -> float | None:
    """The part of the host's ``data_wait`` that reached the device, on a device clock, ms a step, from some
    ``steps`` steps' phase sums and each phase's count of values (a window's, or a run's):
    ``min(data_wait, max(0, period - step - between_steps - between_steps.<name>...))``, each a step's mean (a phase
    absent from some steps counts 0 there; ``period``, absent from a run's first step, is over the steps that have
    one).

    On a device clock ``period`` runs from one step's start on the device to the next's, so what it holds beyond the
    step and the time between steps is the device's time over the fetch: its idle before the step, the most the
    host's wait can have cost.  A device with queued work runs through the wait and that part is ~0.  None where
    ``data_wait``, ``step`` or ``period`` is absent.  (On the host clock the whole wait is exposed: this is not
    for it.)"""
    wait, period, step = sums.get(FETCH), sums.get("period"), sums.get("step")
    if wait is None or period is None or step is None or steps <= 0 or not counts.get("period"):
        return None
    between = sum(v for p, v in sums.items() if p == BETWEEN or p.startswith(BETWEEN_PREFIX))
    return min(wait / steps, max(0.0, period / counts["period"] - (step + between) / steps))


#: Memory's peak phase when the allocator's peak at phase-timer's first read was never passed afterwards (a label the
#: memory measure writes and the table and the memory rules read).
BEFORE = "before the first sampled step"
BEFORE_NOTE = ("set before phase-timer's first read: earlier work in this process; torch.cuda.reset_peak_memory_stats() "
               "before training makes the peak this run's")
