"""The boundaries' side of the sync census: on the last warm-up step, from the close before it to its own.

The census itself (:class:`phase_timer.measures.syncs.SyncCensus`, made by the measure that listens to the core,
:class:`phase_timer.measures.syncs.Syncs`, the core's ``syncs``; a core without one runs no census) turns torch's
sync debug mode on and hears each host-device sync in the phase the boundaries say runs, and what it heard goes back
to that measure; :class:`CensusSteps`
starts and stops it at the closes, on the boundaries' slots (``_census``; ``_census_at``: the close, 1-based, at which it starts, then stops,
which the C boundaries read to leave that close to the methods).
"""

from __future__ import annotations

from typing import Any


class CensusSteps:
    """The census's starts and stops, mixed into the boundaries (no slots of its own: theirs)."""

    __slots__ = ()

    def _plan_census(self, core: Any, warmup: int) -> None:
        """Where the census runs (device clock, two warm-up steps at least), or why it does not."""
        self._census: Any = None
        self._census_at = -1
        syncs = core.measure("syncs")
        if syncs is None:  # no measure listens for it
            return
        if core.clock.kind == "host":
            syncs.status = "not run: no device (host clock)"
        elif warmup < 2:
            syncs.status = f"not run: it needs a warm-up step after the first (warmup_steps={warmup} < 2)"
        else:
            self._census, self._census_at = syncs.census(self.now), warmup - 1

    def _census_unless_running(self) -> None:
        """No step follows the next close: a census not yet running is not started there."""
        if self._census is not None and not self._census.running:
            self._census_at = -1

    def _census_step(self) -> None:
        """The census starts here (the last warm-up step begins), or stops (that step has closed)."""
        census = self._census
        if census is not None and not census.running:
            if census.start():
                self._census_at += 1
                return
        self._end_census()

    def _end_census(self) -> None:
        census, self._census, self._census_at = self._census, None, -1
        if census is not None:
            census.stop()
            self.core.measure("syncs").add(census, self.core.warmup_steps)
