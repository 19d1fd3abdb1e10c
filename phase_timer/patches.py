"""Attributes phase-timer puts on objects it does not own (a Trainer's methods, DDP's registrations, FSDP2's
functions, Lightning's loop), each put back only where it is still phase-timer's: if something wrapped ours since
(another timer, a user's patch), ours stays under it, passing calls on, and theirs is left alone."""

from __future__ import annotations

from typing import Any

_ABSENT = object()


class Patches:
    """Replacements made, in order; :meth:`put_back` undoes them, newest first."""

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: list[tuple[Any, str, Any, Any]] = []

    def __bool__(self) -> bool:
        return bool(self._made)

    def replace(self, owner: Any, name: str, replacement: Any) -> None:
        """``owner.name = replacement`` (an instance's, a class's or a module's own attribute), remembering what
        ``owner`` itself held under ``name`` (or that it held nothing: then an inherited one shows again)."""
        self._made.append((owner, name, vars(owner).get(name, _ABSENT), replacement))
        setattr(owner, name, replacement)

    def put_back(self) -> None:
        """Each replacement undone where ``owner`` still holds it."""
        made, self._made = self._made, []
        for owner, name, previous, replacement in reversed(made):
            if vars(owner).get(name, _ABSENT) is not replacement:
                continue  # wrapped again since: ours stays under it, passing through
            if previous is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
