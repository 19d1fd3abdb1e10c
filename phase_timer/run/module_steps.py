"""The boundaries' side of which module: a modules' sample's hooks, on from its step's begin to its close.

The measure (:class:`phase_timer.measures.modules.ModuleTimes`, one of the core's measures) says which steps are
sampled and puts its hooks on the model; :class:`ModuleSteps` is what the boundaries do for it, on their own slots
(``_mods``: the measure, None when modules are not measured; ``_mod_on``: this step is a sample; ``_mod_after``:
the step (begun) after a gated sample, 0 for none; ``_mod_due``: the step begun at which Python is wanted next, a very
large number for never: the step after a gated sample, the pilot before a sample where a gate is sized, the
sample).  The C boundaries (``_native.Fast``) read
``_mod_on`` and ``_mod_due`` by name and hand a step that is due to the methods, as they do a memory step's, so an
ordinary step pays one comparison and no Python.
"""

from __future__ import annotations

from typing import Any

#: ``_mod_due`` when no sample will come (off, failed, or no model to hook).
NEVER = 1 << 62


class ModuleSteps:
    """A modules' sample's begin and end, mixed into the boundaries (no slots of its own: theirs)."""

    __slots__ = ()

    def _plan_modules(self, core: Any) -> None:
        """The modules measure (``modules.ModuleTimes``), the core's ``modules``, and the first step Python is wanted
        for."""
        self._mods: Any = core.measure("modules")
        self._mod_on = False
        self._mod_after = 0  # the step (begun) after a gated sample, untimed too; 0: none
        self._mod_due = self._mod_wants()

    def _mod_wants(self) -> int:
        """The step (begun) Python is wanted for next: the one after a gated sample; else, where a gate is sized, the
        step before the next sample (its pilot: the host's time of a step, for the run's first gate); else the
        sample's own."""
        mods = self._mods
        if mods is None:
            return NEVER
        if self._mod_after:
            return self._mod_after
        due = mods.next_due
        return due - 1 if mods.gate is not None and due < NEVER else due

    def _mod_begin(self, step: int) -> None:
        """A plain step at or past ``_mod_due`` has begun: the step after a gated sample or the pilot
        (:meth:`_mod_between`), or a sample if the core records it (past the warm-up), else the next recorded one.
        (The verdict's sampled step times the host: the boundaries pass it by, calling :meth:`_mod_between` alone.)

        On the device's clock the sampled step is the measure's: left out of the phases' statistics (untimed, as a
        FLOPs-counting step is), since a sample holds the gate (and may read the allocator)."""
        if self._mod_between():
            return
        if not self.core.recording:
            return
        mods = self._mods
        self._mod_on = mods.begin(self.begun, step)  # type: ignore[union-attr]
        if self._mod_on and mods.untimed:  # type: ignore[union-attr]
            self.core.untime()
            self._mod_after = self.begun + 1 if mods.gate is not None else 0  # type: ignore[union-attr]
        self._mod_due = self._mod_wants()

    def _mod_between(self) -> bool:
        """The step after a gated sample is untimed (the gate can leave the device behind into it, so its phases
        would read the device's time alone, not a step's as the run has them); the step before a sample, where a
        gate is sized, is its pilot (its host time is read at the sample's begin).  True: no sample is due here."""
        mods = self._mods
        if self._mod_after:
            if self.begun == self._mod_after and self.core.recording:
                self.core.untime()
            self._mod_after = 0
        if self.begun >= mods.next_due:  # type: ignore[union-attr]
            return False
        if self.begun == mods.next_due - 1:  # type: ignore[union-attr]
            mods.pilot(self.begun)  # type: ignore[union-attr]
        self._mod_due = self._mod_wants()
        return True

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
