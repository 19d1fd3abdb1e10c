"""The boundaries' side of which module: a modules' sample's hooks, on from its step's begin to its close.

The measure (:class:`phase_timer.measures.modules.ModuleTimes`, one of the core's measures) says which steps are
sampled and puts its hooks on the model; :class:`ModuleSteps` is what the boundaries do for it, on their own slots
(``_mods``: the measure, None when modules are not measured; ``_mod_on``: this step is a sample; ``_mod_due``: the
step begun at which the next one is due, a very large number for never).  The C boundaries (``_native.Fast``) read
``_mod_on`` and ``_mod_due`` by name and hand a step that is due to the methods, as they do a memory step's, so an
ordinary step pays one comparison and no Python.
"""

from __future__ import annotations

from typing import Any

from phase_timer.measures.modules import ModuleTimes

#: ``_mod_due`` when no sample will come (off, failed, or no model to hook).
NEVER = 1 << 62


class ModuleSteps:
    """A modules' sample's begin and end, mixed into the boundaries (no slots of its own: theirs)."""

    __slots__ = ()

    def _plan_modules(self, measures: Any) -> None:
        """The modules measure among the core's measures, and its first sample's step."""
        self._mods: ModuleTimes | None = next((m for m in measures if isinstance(m, ModuleTimes)), None)
        self._mod_on = False
        self._mod_due = self._mods.next_due if self._mods is not None else NEVER

    def _mod_begin(self, step: int) -> None:
        """A plain step at or past ``_mod_due`` has begun: a sample if the core records it (past the warm-up),
        else the next recorded one.  (The verdict's sampled step times the host: the boundaries pass it by.)

        On the device's clock the sampled step is the measure's: left out of the phases' statistics (untimed, as a
        FLOPs-counting step is), since a sample holds the gate (and may read the allocator)."""
        if not self.core.recording:
            return
        mods = self._mods
        self._mod_on = mods.begin(self.begun, step)  # type: ignore[union-attr]
        self._mod_due = mods.next_due  # type: ignore[union-attr]
        if self._mod_on and mods.untimed:  # type: ignore[union-attr]
            self.core.untime()

    def _mod_drop(self) -> None:
        """The step is no training step's (a pause's evaluation, a drop, the run cut off): its sample is dropped."""
        if self._mod_on:
            self._mod_end(False)

    def _mod_end(self, recorded: bool) -> None:
        """The modules' sample is over: hooks off; a recorded step's marks wait to be read."""
        self._mod_on = False
        try:
            self._mods.close(recorded)  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            self._mods, self._mod_due = None, NEVER
            self._warn_once("modules", f"phase-timer: modules are no longer measured ({type(err).__name__}: {err})")
