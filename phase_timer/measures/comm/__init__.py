"""Exposed communication: how long each step waits for the collectives its compute could not hide, every step,
with no sync.

- :mod:`~phase_timer.measures.comm.ddp`: DDP's end-of-backward wait for its all-reduces (``backward.comm_wait``), and its
  comm hooks composed;
- :mod:`~phase_timer.measures.comm.copies`: DDP's copies into ``.grad`` inside that wait, timed on sampled backwards;
- :mod:`~phase_timer.measures.comm.fsdp`: FSDP2's waits for its all-gathers and reduce-scatters (``forward.comm_wait``,
  ``backward.comm_wait``);
- :mod:`~phase_timer.measures.comm.run`: the run's communication, a measure the core listens to.
"""

from __future__ import annotations

from typing import Any

from phase_timer.measures.comm.ddp import DdpComm, attach_ddp, find_ddp
from phase_timer.measures.comm.fsdp import FsdpComm
from phase_timer.measures.comm.run import CARRIED, RunComm, hidden_share, line, scalars, split

__all__ = ["CARRIED", "DdpComm", "FsdpComm", "RunComm", "attach_comm", "attach_ddp", "find_ddp", "hidden_share",
           "line", "scalars", "split"]


def attach_comm(models: Any, core: Any) -> list[Any]:
    """The communication splits of ``models`` into ``core``: each DDP module's, and FSDP2's once if any is sharded
    with ``fully_shard``.  Each has ``remove()``."""
    probes: list[Any] = [p for p in (attach_ddp(m, core) for m in models) if p is not None]
    fsdp = FsdpComm.attach(models, core)
    if fsdp is not None:
        probes.append(fsdp)
    return probes
