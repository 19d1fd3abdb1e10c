"""What a measure is to the core: a listener to the results the engine resolves.

The core (:mod:`phase_timer.run.core`) times phases and resolves them a few steps later; a *measure* is everything
else a run reports that the core does not compute itself.  The core imports no measure: the one that assembles a
run (:func:`phase_timer.doors.assemble.start_core`, or a test) hands it its measures, and the core calls each one, in
order, at these points:

- :meth:`Measure.window` when a window is resolved, before its statistics: the measure takes the values it
  carried on the records out of the columns (they are no phases), may correct the phases it owns, and returns
  the window's scalars (written to every sink at the window's last step, after the phases').
- :meth:`Measure.step` for each step written on its own (``per_step=True``): the same for one step's values.
- :meth:`Measure.report` under torch.distributed, after each window: what this rank's window report carries for
  the measure (rank zero keeps each rank's sums: ``RankTotals.counts``).
- :meth:`Measure.job` on rank zero, for each window of the job's the exchange hands back: its scalars.
- :meth:`Measure.end` once at the run's end, whatever ended it, after the last window, before the verdict: the
  run's last figures and work (the allocator history's last dump, the other ranks' out-of-memory errors), and the
  lines the verdict weighs (MFU's).
- :meth:`Measure.verdict` when the verdict is made (at the end, and so far for the live file): what the rules read
  of the measure (:func:`phase_timer.diagnosis.diagnose`'s keywords).
- :meth:`Measure.cost` for the own-cost line: the host time the measure spends on steps of its own choosing
  (:func:`phase_timer.run.own_cost.estimate`'s keywords).
- :meth:`Measure.line` for the printed table: one line, or None (among the measures' lines, in order; under
  the run's own lines where :attr:`Measure.foot` is set).
- :meth:`Measure.summary` for the summary file: the block at :attr:`Measure.key` (the file's layout and its
  schema are :mod:`phase_timer.outputs.run_summary`'s; a measure fills its block).

A value a measure carries rides on the record open when it resolves (``engine.add_host(name, value)``), so it
reaches the measure with the window that holds that record, in step order, on the training thread.
"""

from __future__ import annotations

from typing import Any


class Measure:
    """A listener to the core's results; every hook is optional (the default does nothing)."""

    #: The summary file's block this measure fills (None: none).
    key: str | None = None
    #: Where the table puts :meth:`line`: among the measures' lines (False), or under the run's own (memory's
    #: block, the own-cost line: True).
    foot = False

    def window(self, columns: dict[str, list[float]]) -> dict[str, float]:
        """A window is resolved: take this measure's carried values out of ``columns`` (each phase's values,
        sorted), correct the phases it owns (sorted stays sorted); the window's scalars."""
        return {}

    def step(self, ms: dict[str, float]) -> None:
        """One step's values, written on their own: take this measure's carried values out, correct its phases."""

    def report(self) -> dict[str, float]:
        """This rank's window report (after :meth:`window`): the values rank zero sums for this rank."""
        return {}

    def state(self) -> dict[str, float]:
        """This rank's window report: what rank zero keeps as this rank's newest (never summed)."""
        return {}

    def job(self, window: Any) -> dict[str, float]:
        """Rank zero: a window of the job's (``distributed.ranks.RankWindow``) is written: its scalars."""
        return {}

    def end(self, totals: Any) -> list[str]:
        """The run's end, before the verdict, with the run's totals (``timing.stats.RunTotals``): the lines the
        verdict weighs (:func:`phase_timer.diagnosis.diagnose`'s ``mfu``)."""
        return []

    def verdict(self) -> dict[str, Any]:
        """What the verdict's rules read of this measure (``diagnose``'s keywords; called on the live file's thread
        too, so a read of a value being changed may raise: the live file then goes without the verdict once)."""
        return {}

    def cost(self) -> dict[str, Any]:
        """The host time this measure spends on the training thread beyond the boundaries' (``estimate``'s
        keywords: memory's reads)."""
        return {}

    def line(self) -> str | None:
        """The table's line (None: nothing to say)."""
        return None

    def summary(self) -> dict[str, Any] | None:
        """The summary file's block at :attr:`key` (None: nothing measured)."""
        return None
