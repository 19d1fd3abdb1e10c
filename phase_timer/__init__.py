"""phase-timer: where each training step's time goes, on the GPU's own clock, lazily.

``PhaseTimer`` (the Lightning callback) and ``PhaseTimerCallback`` (the 🤗 Trainer's)
are imported on first use, so ``import phase_timer`` needs only torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phase_timer.timing.clock import CudaClock, HostClock, make_clock
from phase_timer.config import DISABLE_ENV
from phase_timer.run.core import TimingCore
from phase_timer.diagnosis import Diagnosis
from phase_timer.doors.loop import LoopTimer, attach

if TYPE_CHECKING:
    from phase_timer.doors.hf_trainer import PhaseTimerCallback
    from phase_timer.doors.lightning import PhaseTimer

__all__ = ["DISABLE_ENV", "CudaClock", "Diagnosis", "HostClock", "LoopTimer", "PhaseTimer", "PhaseTimerCallback", "TimingCore", "attach", "make_clock"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "PhaseTimer":
        from phase_timer.doors.lightning import PhaseTimer

        return PhaseTimer
    if name == "PhaseTimerCallback":  # the 🤗 Trainer door: imports transformers, so only on use
        from phase_timer.doors.hf_trainer import PhaseTimerCallback

        return PhaseTimerCallback
    raise AttributeError(f"module 'phase_timer' has no attribute {name!r}")
