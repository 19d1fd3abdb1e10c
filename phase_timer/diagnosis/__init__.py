"""The verdict: which bottleneck holds the run back, why, and what to try -- from the numbers we have.

Every rule reads signals the timer already collects (the run totals, the sampled steps in flight and host step
times, each window's spread, the ranks' windows, the loader's settings) and adds no sync.  A rule whose signal is
missing abstains: a missing signal is never a zero.  The rules come in families, a module each, over one run:

- ``finding``: what a finding is (``Diagnosis``, ``KINDS``) and every threshold (``docs/diagnosis.md`` explains each);
- ``signals``: what the rules read beyond the run totals (``Signals``);
- ``time_rules``: input, the copy, Lightning's per-batch sync, host or GPU bound, unstable, changed, MFU;
  ``input_advice`` (INPUT_BOUND's advice) and ``cpu_use`` (the CPU shares it reads);
- ``run_change``: a phase whose level moved for good partway through the run (RUN_CHANGED);
- ``rank_rules``: the straggler and exposed communication;
- ``memory_rules`` and ``oom_rules``: memory, and an out-of-memory error that ended the run;
- ``module_rules``: which module the verdict names (the one that holds the most of a GPU-bound run's slow phase);
- ``verdict``: the rules in order, the primary finding and the rest, the verdict as text.
"""

from phase_timer.diagnosis.finding import KINDS, MIN_FLIGHT_SAMPLES, MIN_STEPS, Diagnosis, phase_share
from phase_timer.diagnosis.memory_rules import memory_findings
from phase_timer.diagnosis.oom_rules import out_of_memory
from phase_timer.diagnosis.signals import Signals
from phase_timer.diagnosis.verdict import diagnose, format_verdict

__all__ = ["KINDS", "MIN_FLIGHT_SAMPLES", "MIN_STEPS", "Diagnosis", "Signals", "diagnose", "format_verdict",
           "memory_findings", "out_of_memory", "phase_share"]
