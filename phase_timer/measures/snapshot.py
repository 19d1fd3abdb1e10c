"""``memory_snapshot=``'s measure (:class:`Snapshot`): the allocator's history, recorded from the run's start and
dumped on an out-of-memory error (:mod:`phase_timer.measures.oom` notes the error) or at the run's end."""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

from phase_timer import files
from phase_timer.measure import Measure
from phase_timer.measures.oom import SNAPSHOT_KEY, _end_failed, _published, _ranked
from phase_timer._env import warn

log = logging.getLogger(__name__)

#: ``memory_snapshot``: the allocator's history keeps at most this many alloc/free events (a ring: the newest
#: kept).  PyTorch's docs put an event at "several KB" with its stack: a few hundred MB of host memory at most.
SNAPSHOT_ENTRIES = 100_000
SNAPSHOT_FILE = "memory_snapshot.pickle"


class Snapshot(Measure):
    """``memory_snapshot=``: the allocator's history, recorded from the run's start, dumped on an out-of-memory
    error (and at the end with ``"end"``).  ``True``/``"end"``: ``memory_snapshot.pickle`` in the run's directory;
    a path: that file.  Rank r > 0 of a distributed job adds ``.rank<r>`` before the suffix.

    A measure (registered only where asked): it fills the summary file's ``memory_snapshot`` (null: not asked), and
    its recording stops at the run's end (:meth:`end`)."""

    key = SNAPSHOT_KEY

    def __init__(self, setting: Any, directory: str | None, ranks: Any = None) -> None:
        self.ranks = ranks
        self.at_end = setting == "end"
        self.target = None if setting is True or self.at_end else os.fspath(setting)
        self.directory = directory
        self.recording = False
        self.path: str | None = None
        self.dumped: str | None = None  # "oom" or "end"
        self.error: str | None = None

    @classmethod
    def start(cls, setting: Any, core: Any, directory: str | None, stacklevel: int = 4) -> Snapshot | None:
        """Recording starts now (CUDA), for ``core``'s clock and ranks; elsewhere one warning (at ``stacklevel``
        from here), and the run goes on without it."""
        if setting is None or setting is False:
            return None
        snap = cls(setting, directory, core.ranks)
        if core.clock.kind != "cuda":
            snap.error = "it needs a CUDA device, and this run is on the host clock: nothing was recorded"
            warn(log, f"phase-timer: memory_snapshot={setting!r}: {snap.error}", stacklevel)
            return snap
        try:
            import torch

            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=SNAPSHOT_ENTRIES)
            snap.recording = True
        except Exception as err:  # noqa: BLE001 - a torch without it: time the run all the same
            snap.error = f"the allocator's history could not be recorded ({type(err).__name__}: {err})"
            warn(log, f"phase-timer: memory_snapshot={setting!r}: {snap.error}", stacklevel)
        return snap

    def dump(self, when: str) -> str | None:
        """The snapshot, written atomically (a temporary file, then a rename); its path, or None (why: ``error``)."""
        if not self.recording or self.dumped is not None:
            return self.path
        path = self._path()
        if path is None:
            self.error = "no directory to write it in (rank zero wrote no files, or the store did not say where)"
            return None
        try:
            import torch

            data = torch.cuda.memory._snapshot()  # the allocator's state and history: host data, no sync
            files.write(path, pickle.dumps(data))  # atomic where local; the logger's fsspec URL too
        except Exception as err:  # noqa: BLE001 - a full disk: the finding still says what it knows
            self.error = f"the snapshot could not be written ({type(err).__name__}: {err})"
            warn(log, f"phase-timer: {self.error}", 3)
            return None
        self.path, self.dumped = path, when
        return path

    def end(self, totals: Any = None) -> list[str]:
        """The run's end, whatever ended it: the end's dump when asked (unless an out-of-memory error's came
        first); recording stops.  Never raises."""
        try:
            self.stop()
        except Exception as err:  # noqa: BLE001 - the run's numbers are written whatever happens here
            _end_failed(err)
        return []

    def stop(self) -> None:
        """The end's dump when asked (unless an out-of-memory error's came first); recording stops."""
        if not self.recording:
            return
        try:
            if self.at_end:
                self.dump("end")
        finally:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def _path(self) -> str | None:
        rank = self.ranks.rank if self.ranks is not None else 0
        if self.target is not None:
            return _ranked(self.target, rank)
        directory = self.directory if rank == 0 else (_published(self.ranks) or {}).get("directory")
        return _ranked(files.join(directory, SNAPSHOT_FILE), rank) if directory else None

    def summary(self) -> dict[str, Any]:
        return self.as_dict()

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "dumped": self.dumped, "at_end": self.at_end, "max_entries": SNAPSHOT_ENTRIES,
                "error": self.error}
