"""The boundaries' side of what a batch holds: its samples and tokens (throughput) and, at a step's first batch,
its FLOPs (the FLOP plan), both counted from shapes on the host, never from values: no sync.

The counter and the plan are the core's measures' (``measures/throughput.py``, ``measures/step_flops.py``), found
by their summary blocks' keys (``throughput``, ``flops``): the run imports no measure.  A shape not yet counted is
counted on its step, which goes untimed (the boundaries' ``_count_step`` swaps in the counting step's class,
``run/sampled.py``).
"""

from __future__ import annotations

from typing import Any

from phase_timer.signature import signature


class BatchCounts:
    """What counts each batch, mixed into the boundaries (no slots of its own: theirs, ``counter`` and ``flops``)."""

    __slots__ = ()

    def _find_counts(self, core: Any) -> None:
        #: Throughput's counter (``throughput.BatchCounter``) and the FLOP plan (``step_flops.FlopPlan``), the core's
        #: measures' (None: not counted).
        throughput = core.measure("throughput")
        self.counter: Any = throughput.counter if throughput is not None else None
        self.flops: Any = core.measure("flops")

    def count_batch(self, batch: Any, step_batch: Any = None, samples: bool = True) -> None:
        """A batch was handed over (after :meth:`batch`): its samples and tokens, and at a step's first batch
        its FLOPs (``step_flops.py``).  ``step_batch``: what the step's FLOPs depend on when the door has every
        micro-batch at once (the 🤗 Trainer's), else ``batch``; ``samples=False``: its FLOPs only.  Shapes only,
        never a value: no sync.
        Every step pays this: one frame, the signature, a dict lookup and three host values (a few µs)."""
        core = self.core
        counter = self.counter
        if counter is not None and samples:
            counter.add(core.add_host, batch)
        plan = self.flops
        if plan is None or plan.begun == self.begun or not self.open:
            return
        plan.begun = self.begun
        if step_batch is None:
            step_batch = batch
        try:
            carried = plan.given_carried or plan.carried.get(signature(step_batch))
        except TypeError as err:  # a batch item whose .shape is no shape (unhashable): no FLOPs, training goes on
            self.flops, plan.dropped = None, True
            self._warn_once("flops", f"phase-timer: the batch's shapes cannot be read ({err}); no FLOPs nor MFU")
            return
        if carried is None:
            self._count_step(plan, step_batch)
            return
        add = core.add_host
        for name, value in carried:
            add(name, value)
