"""Which module: each module's forward and backward time and the activation memory it keeps, on sampled steps.

The phases say *that* backward is 65% of the step; this measure says *which part of the model* it is.  On a
sampled step (:data:`DENSE` of them early, or one a group where there are more, then one in about
:data:`GAP_MEAN`) hooks are put on one *group* of the tree's rows (:meth:`Tree.groups`: at most
:data:`GROUP_MODULES` modules, the groups in turn) at the step's begin and taken off at its close; the ordinary step
has no hook at all, and the table is full once each group has had a sample read.  The step is due
the way a memory step is (``Boundaries._mod_due``: the C boundaries hand a step that is due to Python, one
comparison a step), so an ordinary step pays nothing in Python.

What a hook does, on the run's clock (CUDA events on the current stream; the host's perf counter on a CPU):

- **forward**: a module's forward pre-hook and forward hook each take a mark; the time between is its forward (on
  the device: between its first and last kernel's enqueue points on the stream).  A module called twice in a step
  (shared weights, recurrence) sums its calls.
- **backward**, with no hook that wraps a tensor: a call's nodes are those numbered (autograd's creation order) from
  its pre-hook's next sequence number to its forward hook's.  When the outermost hooked call ends, each call gets a
  pre-hook (``Node.register_prehook``) on its output nodes and a post-hook (``Node.register_hook``) on its oldest
  node (:func:`_oldest`: autograd runs a device's ready nodes newest first, so the oldest is the call's last), one a
  node for all the nested calls that share it.  The backward is from the first output node about to run to the
  oldest done (on a device's clock, past the sums of the oldest's gradients autograd's engine makes after it, at the
  first parameter's node it feeds, where that runs next: :meth:`Sample._after`): the gradients for its outputs, then
  those for its inputs and parameters.  Full backward hooks
  (``register_full_backward_hook``) are not used: they wrap inputs and outputs in a ``BackwardHookFunction`` that
  makes an in-place op on an output fail.  Tensors the module uses without making them (a cache made earlier) are
  outside it, as they should be.
- **activations** (CUDA), on a group's first sample and one of its samples in :data:`ACT_EVERY`: the caching
  allocator's ``allocated`` after the forward less before it (one read of its counters, no sync, before the first
  mark and after the last): what the forward left allocated, its output and what autograd saved for backward.  On a
  CPU there is no allocator to read: not measured (absent, never zero).
- **the gate** (CUDA): the compute stream waits on a side stream's sleep, so that the sample's kernels are queued
  before the device runs them and the marks hold device time only; a span whose marks were not all queued before
  the device reached the mark before each is not read, nor the rest of its row's phase in that sample
  (:meth:`Sample.values`).  Its length, per group, is what the group's last sample read needed (the host's time to
  each mark less the device's time known to be its own before it), with a margin, never past the run's step period;
  the run's first, the host's time of the step before with the margin (:class:`_Gate`).  On the device a sampled
  step is untimed, and so is the step after it (the gate can leave the device behind into it): the phases'
  statistics leave both out.
- **activation checkpointing**: a forward that runs while autograd runs a backward is a *recompute*: reported as
  ``recompute_ms``, never added to forward.  Non-reentrant checkpointing (``use_reentrant=False``) keeps the graph,
  so a checkpointed module's backward is measured and includes its recompute; with reentrant checkpointing the
  first forward runs without grad, and a module inside the region has no backward of its own (its enclosing
  module's has it).
- **torch.compile and CUDA graphs**: no hook fires inside a compiled region or a graph replay.  A compiled model
  (``torch.compile(model)``, ``model.compile()``) is not measured, and the table and the summary file say so; a
  compiled submodule is left out with everything under it, named.  Never a wrong number.

Marks are resolved lazily: a sample is read at a window's end once its every mark is done (``clock.done``, a
query),
and at the run's end after the engine's drain; nothing here waits for the device.

Cost: on a sample, for its group's modules, two hooks a module put into its hook dicts, a search for each call's
oldest node, two marks a module call and one a hooked node in backward (a 12-layer GPT-2's default tree, bf16
autocast, five groups: a group's sample 45.8 node hooks and 63.8 marks on average);
``benchmarks/modules_cost.py`` measures a sample's host time per group and the amortized cost a step.
``docs/modules.md`` says what is measured and what is not.
"""

from __future__ import annotations

# The names below are the package's; each is read in the module that defines it (patch it there: ``times.DENSE``,
# ``tree.GROUP_MODULES``, ``gate.GATE_MARGIN``), and these are copies.
from phase_timer.measures.modules.gate import (GATE_CYCLES_PER_MS, GATE_EASE, GATE_FIRST_MS, GATE_MARGIN,
                                               GATE_MARGIN_MAX, GATE_MARGIN_START, GATE_MAX_MS, GATE_MIN_MS,
                                               GATE_PAD_MS, _Gate)
from phase_timer.measures.modules.sample import Sample, _oldest
from phase_timer.measures.modules.times import (ACT_EVERY, DENSE, DENSE_GAP, GAP, GAP_MEAN, GATE, HOST_DENSE,
                                                NOT_COMPILED_NOTE, PREFIX, RAW_KEPT, SEED, TABLE_TOP, ModuleTimes, make)
from phase_timer.measures.modules.tree import (DEFAULT_SEARCH, GROUP_MODULES, VOCAB_OUTPUTS, Entry, Tree, build_tree,
                                               check_modules, compiled_module, module_kind, tag_key)

__all__ = ["ACT_EVERY", "DEFAULT_SEARCH", "DENSE", "DENSE_GAP", "GAP", "GAP_MEAN", "GATE", "GATE_CYCLES_PER_MS",
           "GATE_EASE", "GATE_FIRST_MS", "GATE_MARGIN", "GATE_MARGIN_MAX", "GATE_MARGIN_START", "GATE_MAX_MS",
           "GATE_MIN_MS", "GATE_PAD_MS", "GROUP_MODULES", "HOST_DENSE",
           "NOT_COMPILED_NOTE", "PREFIX", "RAW_KEPT", "SEED", "TABLE_TOP", "VOCAB_OUTPUTS", "Entry", "ModuleTimes",
           "Sample", "Tree", "_Gate", "_oldest", "build_tree", "check_modules", "compiled_module", "make",
           "module_kind", "tag_key"]
