"""What every door has besides its hooks: its results, their words, and the end of its run.

A door times a run (Lightning: each ``fit``; the plain loop: from ``attach`` to ``close``; the
🤗 Trainer: each ``train()``) and ends it one way for all (:meth:`Door._ended`): the core
resolves what is pending (the one wait for the device) and writes; the door keeps what it found
(:data:`RESULTS`, attributes of the door) and prints the table on rank zero, or on a rank that
ran out of memory.  While the run is open it is registered with :mod:`phase_timer.doors.lifecycle`,
which writes it at interpreter exit or on SIGTERM if the door's own end never comes.

A door's docstring takes the shared words from here and from :mod:`phase_timer.doors.options`
(:func:`documented`): each is written once, and ``help()`` shows every door whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from phase_timer.doors import lifecycle

from phase_timer.measures import oom
from phase_timer.config import disabled_by_env
from phase_timer.doors.options import entries, put
from phase_timer.timing.stats import RunTotals

if TYPE_CHECKING:
    from phase_timer.run.core import TimingCore
    from phase_timer.diagnosis import Diagnosis
    from phase_timer.doors.options import Options
    from phase_timer.measures.syncs import SyncSite

_T = TypeVar("_T")

#: Each result's entry in the doors' docstrings: what a door holds after its run.
RESULTS = {
    "totals": "a :class:`phase_timer.timing.stats.RunTotals` of every timed step (an empty one when disabled).",
    "last_summary": "the summary table as printed (rank zero).",
    "diagnosis": "the verdict, a :class:`phase_timer.Diagnosis` (rank zero).",
    "summary_path": "where rank zero wrote ``phase_timer_summary.json`` (None: not written).",
    "log_dir": "the directory the TensorBoard values go to, known from the run's start: a writer's or a logger's, "
               "or our own (None: none).",
    "syncs": "the host-device syncs of one warm-up step, each a :class:`phase_timer.measures.syncs.SyncSite` (phase, "
             "where, code, count, known cause).",
    "sync_census": "whether the sync census ran, or why not.",
}


def documented(*, run: str, end: str) -> Callable[[_T], _T]:
    """Put the shared words into a door's docstring: its line ``{options}`` becomes every shared argument's entry
    (:func:`phase_timer.doors.options.entries`, in the door's terms: ``run`` is its run, ``end`` where it ends), its
    line ``{results}`` every result's."""

    def fill(door: _T) -> _T:
        doc = put(door.__doc__, "{options}", entries(run=run, end=end))
        door.__doc__ = put(doc, "{results}", [f"{name}: {words}" for name, words in RESULTS.items()])
        return door

    return fill


class Door:
    """A door's results (``None`` until its run ends) and its run's end; a mixin of every door that times."""

    __slots__ = ()  # the plain door keeps its hooks' state in slots of its own
    config: Options
    totals: RunTotals | None = None
    last_summary: str | None = None
    diagnosis: Diagnosis | None = None
    summary_path: str | None = None
    log_dir: str | None = None
    syncs: tuple[SyncSite, ...] = ()
    sync_census: str | None = None
    _open_key: int | None = None  # registered with lifecycle while the run is open
    _comm: list[Any] | tuple[()] = ()  # DDP's and FSDP2's probes on the run's model (phase_timer/measures/comm)

    def _opened(self, core: TimingCore) -> None:
        """The run is open: if nobody ends it, :mod:`phase_timer.doors.lifecycle` calls ``_close_unclosed`` (under
        torch.distributed at interpreter exit only: a rank stuck in a collective still ends at once on SIGTERM)."""
        self._open_key = lifecycle.register(self._close_unclosed, sigterm=core.ranks is None)

    def _close_unclosed(self, interrupted: bool, why: str) -> None:
        """Write the run nobody ended (``why``: "at interpreter exit", "on SIGTERM")."""
        raise NotImplementedError

    def _closing(self) -> None:
        """The run ends here: no longer one for :mod:`phase_timer.doors.lifecycle` to write."""
        lifecycle.unregister(self._open_key)
        self._open_key = None

    def _drop_comm(self, core: TimingCore | None) -> None:
        """The communication probes come off the run's model (their split is the run's, ``core``'s)."""
        comm, self._comm = self._comm, []
        for probe in comm:
            probe.remove(core)

    def _ended(self, core: TimingCore, *, interrupted: bool, wait: bool = True, table: bool = True) -> RunTotals:
        """Resolve what is pending and write (``wait=False``: no wait for the device, on SIGTERM), keep the results,
        and print the table on rank zero (``table=False``: no table made)."""
        # The one blocking wait: pending steps are resolved and written (and the other ranks' last reports
        # awaited, briefly when the run failed: a rank may be gone).
        self.totals = core.finish(rank_timeout_s=self.config.rank_timeout_s, interrupted=interrupted, wait=wait)
        self.diagnosis, self.summary_path = core.diagnosis, core.summary_path
        census = core.measure("syncs")
        if census is not None:
            self.syncs, self.sync_census = tuple(census.sites), census.status
        if table:
            self.last_summary = core.summary_table("phase-timer" + (" (interrupted)" if interrupted else ""))
            if self.config.summary and (core.ranks is None or core.ranks.rank == 0 or oom.own(core)):
                print(self.last_summary, flush=True)  # a rank that ran out of memory says so too
        return self.totals


def _through(name: str) -> property:
    default = getattr(Door, name)
    return property(lambda self: getattr(self.timer, name) if self.timer is not None else default, doc=RESULTS[name])


def _totals(door: ThroughTimer) -> RunTotals | None:
    if door.timer is not None:
        return door.timer.totals
    return RunTotals() if not door.enabled or disabled_by_env() else None  # a disabled door's exist, and are empty


class ThroughTimer:
    """The results of a door that makes a :class:`Door` for each run (the 🤗 callback: a LoopTimer per
    ``train()``), read through its ``timer``: the last run's."""

    timer: Door | None
    enabled: bool

    totals = property(_totals, doc=RESULTS["totals"])
    last_summary = _through("last_summary")
    diagnosis = _through("diagnosis")
    summary_path = _through("summary_path")
    log_dir = _through("log_dir")
    syncs = _through("syncs")
    sync_census = _through("sync_census")
