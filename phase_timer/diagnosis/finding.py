"""What a finding is (kind, severity, why, what next, evidence) and the thresholds every rule reads;
``docs/diagnosis.md`` explains each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phase_timer.phases import RANK_WAITS, TOTALS


#: Fewer timed steps than this, and no other rule speaks.
MIN_STEPS = 20


#: A share of ``period`` (or of ``step`` for ``h2d``) at or above this is material ...
MATERIAL = 0.10


#: ... and at or above this, high.
HIGH = 0.30


#: Sampled steps needed before the host/device rules speak.
MIN_FLIGHT_SAMPLES = 4


#: HOST_BOUND: in at least this share of sampled steps the device had finished every earlier step ...
HOST_IDLE_SHARE = 0.5


#: ... and the device's step lasted less than this many times the host's time to issue it ...
PACED_RATIO = 1.25


#: ... and the device was more than a phase behind the host at fewer than this share of the sampled
#: steps' boundaries (at or above it the device is busy, even when the host is held to its pace).
#: Calibrated on an H100 against the device's busy share on the profiler's timeline (docs/diagnosis.md):
#: 0-30% in host-held runs (busy 0.45-0.66; the step's tail boundary alone reads ~10%), 44-100% in
#: GPU-bound ones (a sync mid-step on a busy GPU: 44-50%; the host far ahead: 100%).
BEHIND_SHARE = 0.35


#: UNSTABLE: a window is spiky when p90/p50 or max/p50 of ``step`` or ``period`` reach these ...
SPIKE_P90 = 1.5


SPIKE_MAX = 4.0


#: ... counting windows of at least this many steps; it fires when more than this share of them are,
SPIKY_SHARE = 0.5


#: with at least this many windows.
MIN_WINDOWS = 3


#: RANK_STRAGGLER: the same rank slowest in one phase in at least this share of the windows (and 3) ...
STRAGGLER_SHARE = 0.6


#: ... by at least this share of the window's median ``period`` (and 0.05 ms).
STRAGGLER_MARGIN = 0.05


#: The optimizer's share of ``step`` above which a fused optimizer is suggested.
OPTIMIZER_SHARE = 0.2


#: Phases in which the other ranks' wait for a slow one shows; they are never the straggler's.
WAIT_PHASES = RANK_WAITS | set(TOTALS)


#: Memory (CUDA; ``docs/diagnosis.md``).  MEMORY_PRESSURE: the peak reserved at or above this share of the
#: device's memory (high at PRESSURE_HIGH), or any allocation the allocator had to retry after freeing its cache.
PRESSURE_SHARE = 0.90


PRESSURE_HIGH = 0.95


#: MEMORY_HEADROOM: the peak reserved at or below this share of the device; the estimate fills FILL_SHARE of it.
HEADROOM_SHARE = 0.5


FILL_SHARE = 0.85


#: MEMORY_CREEP: allocated at the step's begin rises by at least CREEP_MIN_MB over at least CREEP_POINTS steady
#: samples, between at least CREEP_RISING of consecutive ones; high when the device would be full within
#: CREEP_HIGH_STEPS steps at that rate.
CREEP_MIN_MB = 64.0


CREEP_POINTS = 4


CREEP_RISING = 0.75


CREEP_HIGH_STEPS = 10_000


#: MEMORY_FRAGMENTATION: the peak reserved at or above FRAG_RATIO x the peak allocated, by FRAG_MIN_MB or more.
FRAG_RATIO = 1.3


FRAG_MIN_MB = 1024.0


#: MEMORY_RANK_IMBALANCE: the largest rank's peak allocated above the other ranks' median by this share and
#: IMBALANCE_MIN_MB.
IMBALANCE_SHARE = 0.1


IMBALANCE_MIN_MB = 512.0


#: OUT_OF_MEMORY (an out-of-memory error ended the run; ``phase_timer/measures/oom.py`` says what was known): it came in
#: one of the first OOM_FIRST_STEPS steps begun (the first optimizer step makes the optimizer's state) ...
OOM_FIRST_STEPS = 2


#: ... activations are large at OOM_ACTIVATIONS of what the step wanted (allocated at the failure plus the request)
#: or of the peak allocated; the optimizer's state at OOM_OPTIMIZER of the device (or of what the step wanted);
#: the cache held in pieces when what was reserved but unallocated could have held the request (and OOM_FRAG_MIN_MB).
OOM_ACTIVATIONS = 0.3


OOM_OPTIMIZER = 0.25


OOM_FRAG_MIN_MB = 256.0


#: COMM_BOUND: the exposed communication's share of the step on the rank that waits least.
COMM_MATERIAL = 0.10


KINDS = (
    "TOO_FEW_STEPS", "INPUT_BOUND", "H2D_BOUND", "SYNC_WAIT", "RANK_STRAGGLER", "COMM_BOUND", "HOST_BOUND", "UNSTABLE",
    "RUN_CHANGED", "GPU_BOUND", "MEMORY_PRESSURE", "MEMORY_CREEP", "MEMORY_FRAGMENTATION", "MEMORY_RANK_IMBALANCE",
    "MEMORY_HEADROOM", "MFU_IMPOSSIBLE", "OUT_OF_MEMORY", "NO_FINDING",
)


@dataclass(frozen=True)
class Diagnosis:
    """A finding: its ``kind``, ``severity`` (``high``, ``medium``, ``info``), ``why``, ``next`` steps and ``evidence``.

    The primary finding also carries the other findings that fired, in order, as ``secondary``.
    """

    kind: str
    severity: str
    why: str
    next: tuple[str, ...]
    evidence: dict[str, Any] = field(default_factory=dict)
    secondary: tuple[Diagnosis, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "severity": self.severity, "why": self.why, "next": list(self.next),
               "evidence": dict(self.evidence)}
        out["secondary"] = [d.as_dict() for d in self.secondary]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diagnosis:
        """The finding :meth:`as_dict` wrote (as the run summary file holds it)."""
        return cls(d["kind"], d["severity"], d["why"], tuple(d.get("next") or ()), dict(d.get("evidence") or {}),
                   tuple(cls.from_dict(s) for s in d.get("secondary") or ()))


def phase_share(totals: Any, phase: str, base: str) -> float | None:
    p, b = totals.phases.get(phase), totals.phases.get(base)
    if p is None or b is None or b.total <= 0:
        return None
    return p.total / b.total


def _severity(share: float) -> str:
    return "high" if share >= HIGH else "medium"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"
