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
  oldest done: the gradients for its outputs, then those for its inputs and parameters.  Full backward hooks
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
autocast: 65 modules, 116 node hooks and 244 marks when all are hooked; a group's sample 25.6 node hooks and 51.2
marks on average);
``benchmarks/modules_cost.py`` measures a sample's host time per group and the amortized cost a step.
``docs/modules.md`` says what is measured and what is not.
"""

from __future__ import annotations

import heapq
import logging
import random
import re
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from phase_timer._env import warn
from phase_timer.measure import Measure

log = logging.getLogger(__name__)

#: A sample hooks one *group* of the tree's rows, the groups in turn: the rows, in the tree's order, packed into groups
#: of at most GROUP_MODULES module objects (a row is never split, since its modules are summed on one step; a row of
#: more is a group alone).  A sample costs about its group's share of hooking them all, and the table is full after
#: one sample of each group (a 12-layer GPT-2's default tree: 5 groups).
GROUP_MODULES = 16
#: The first samples after the warm-up come DENSE_GAP steps apart, DENSE of them (and the one the last schedules), or
#: as many as the groups where there are more (a short run gets every row) ...
DENSE = 4
DENSE_GAP = 8
#: ... on the device's clock.  On the host clock a sampled step's phases hold its hooks' host time (the host clock
#: is the work), which would make every window of a cheap step read spiky (UNSTABLE): there, HOST_DENSE of them.
HOST_DENSE = 0
#: ... then one in GAP (at random in it, so that no periodic work aliases with the samples): a mean of 1,024 steps,
#: so that a row is read again about every 5,000 steps of a long run (a 12-layer GPT-2's 5 groups).
GAP = (640, 1408)
GAP_MEAN = sum(GAP) // 2
#: The generator's seed: the same steps sampled in every run (a recorded run stays the same).
SEED = 50
#: CUDA: a group's first sample, then one of its samples in ACT_EVERY, also reads the allocator around each forward
#: (activations): a read is 10-24 µs of host time, taken outside the module's own marks, inside its parent's (the gate
#: keeps the device's spans clear of the host's time).
ACT_EVERY = 4
#: CUDA: a sample's gate (``_Gate``), per group: the run's first one's length without the host's time of the step
#: before (GATE_FIRST_MS; with it, that times GATE_MARGIN plus GATE_PAD_MS); then, from the group's last sample read,
#: the sleep that would have left every mark queued in time (the host's time to each mark less the device's time
#: known to be its own before it, at most) times GATE_MARGIN plus GATE_PAD_MS, within
#: [GATE_MIN_MS, GATE_MAX_MS] and never past the run's median step period (times the margin, plus the pad) once a
#: window has been read; the SM clock's rate assumed until a sleep is measured (cycles a ms).
GATE = True
GATE_FIRST_MS = 10.0
GATE_MARGIN = 1.25
GATE_PAD_MS = 0.25
GATE_MIN_MS = 0.5
GATE_MAX_MS = 100.0
GATE_CYCLES_PER_MS = 1.5e6
#: Samples kept per module for the summary file's raw values (the most recent).
RAW_KEPT = 32
#: A Linear head with at least this many outputs is a vocabulary head (the advice differs).
VOCAB_OUTPUTS = 8192
#: How deep the default tree looks for repeated blocks under a top-level child.
DEFAULT_SEARCH = 4
#: The table names this many modules of each of forward and backward.
TABLE_TOP = 3
PREFIX = "phase_module"
MB = float(1 << 20)
#: Said when no sample could be resolved (the summary's note; the table's line).
NOT_COMPILED_NOTE = ("hooks do not fire inside a compiled region (torch.compile) or a CUDA graph's replay, so its "
                     "modules' times are not known here; a run without compile measures them")


def tag_key(key: str) -> str:
    """A row's name as every sink takes it (MLflow allows no brackets): ``h[0-11]`` -> ``h.0-11``, ``[*]`` -> ``.all``."""
    return re.sub(r"\[(\d+)-(\d+)\]", r".\1-\2", key).replace("[*]", ".all")


def check_modules(owner: str, name: str, value: Any) -> None:
    """``modules``: True (the default tree), False (off), an int depth >= 1, or a list of module names."""
    from phase_timer.config import _fail

    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if value < 1:
            _fail(owner, name, value, "True, False, a depth (an int >= 1) or a list of module names")
        return
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return
    _fail(owner, name, value, "True, False, a depth (an int >= 1) or a list of module names (non-empty strings)")


# -- the tree ---------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One row of the tree: a module, or repeated blocks (``h[0-11]``) or their like children summed."""

    key: str
    parent: str | None
    kind: str  # what the advice is for: attention, vocab_head, embedding, conv, norm, mlp, block, other
    modules: int = 0  # module objects summed in this row


@dataclass
class Tree:
    """What a sampled step hooks: each module object (weakly: the run never keeps a model alive, nor through it the
    door that hooks it) and the row it adds to, and the rows in display order."""

    entries: dict[str, Entry] = field(default_factory=dict)
    targets: list[tuple[weakref.ref[nn.Module], str]] = field(default_factory=list)
    #: Modules left out because they are compiled (their names), and whether the whole model is.
    compiled: list[str] = field(default_factory=list)
    whole_compiled: bool = False

    def add(self, module: nn.Module, key: str, parent: str | None, name: str) -> None:
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Entry(key, parent, module_kind(module, name))
        entry.modules += 1
        self.targets.append((weakref.ref(module), key))

    def modules(self, keys: Iterable[str] | None = None) -> list[tuple[nn.Module, str]]:
        """The hooked modules still alive, with their rows (those of ``keys``' rows only, when given)."""
        if keys is not None and not isinstance(keys, (set, frozenset)):
            keys = set(keys)
        return [(m, key) for ref, key in self.targets if (keys is None or key in keys) and (m := ref()) is not None]

    def groups(self, budget: int | None = None) -> list[frozenset[str]]:
        """The rows, in the tree's order, packed into groups of at most ``budget`` module objects
        (:data:`GROUP_MODULES`); a row is never split, and a row of more modules is a group alone."""
        budget = GROUP_MODULES if budget is None else budget
        out: list[list[str]] = []
        n = 0
        for key, entry in self.entries.items():
            if out and n + entry.modules <= budget:
                out[-1].append(key)
                n += entry.modules
            else:
                out.append([key])
                n = entry.modules
        return [frozenset(g) for g in out]


def module_kind(module: nn.Module, name: str) -> str:
    """What kind of module this is, for the advice: from its class and its name."""
    cls = type(module).__name__.lower()
    low = name.lower().rsplit(".", 1)[-1]
    if isinstance(module, nn.Embedding) or isinstance(module, nn.EmbeddingBag):
        return "embedding"
    if isinstance(module, nn.Linear) and module.out_features >= VOCAB_OUTPUTS:
        return "vocab_head"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if "attn" in cls or "attention" in cls or "attn" in low or "attention" in low:
        return "attention"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)) or "norm" in cls:
        return "norm"
    if "mlp" in cls or "mlp" in low or "feedforward" in cls or low in ("ffn", "ff", "feed_forward"):
        return "mlp"
    if "embed" in cls or low in ("wte", "wpe"):
        return "embedding"
    return "other"


def compiled_module(module: nn.Module) -> bool:
    """The module runs compiled: ``torch.compile(module)`` (an ``OptimizedModule``) or ``module.compile()``."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def _repeated(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """A container's children when they are two or more blocks of one class (a ModuleList of layers), else None."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return None
    kids = list(module.named_children())
    if len(kids) < 2 or len({type(m) for _, m in kids}) != 1 or not any(True for _ in kids[0][1].children()):
        return None
    return kids


def _span(names: Sequence[str]) -> str:
    """``[0-11]`` for indices in a row, else ``[*]``."""
    if all(n.isdigit() for n in names):
        idx = [int(n) for n in names]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return f"[{idx[0]}-{idx[-1]}]"
    return "[*]"


def _holds_blocks(module: nn.Module, depth: int) -> bool:
    if depth <= 0:
        return False
    return any(_repeated(c) is not None or _holds_blocks(c, depth - 1) for c in module.children())


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model under DDP's or DataParallel's wrapper."""
    for _ in range(4):
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = inner
        else:
            break
    return model


def build_tree(models: Sequence[nn.Module], spec: Any, owner: str = "attach") -> Tree:
    """The rows a sampled step measures, for ``modules=spec`` (True, an int depth, or names).

    Default (True): each model's top-level children; a child that holds repeated blocks is opened (``transformer``
    -> ``transformer.wte``, ``transformer.h[0-11]``...), and repeated blocks are one row with each of their children
    summed over the blocks (``transformer.h[0-11].attn``).  Several models: each one's rows under ``<i>.``."""
    tree = Tree()
    roots = [_unwrap(m) for m in models]
    for i, root in enumerate(roots):
        prefix = f"{i}." if len(roots) > 1 else ""
        if compiled_module(root):
            tree.whole_compiled = True
            tree.compiled.append(prefix.rstrip(".") or type(root).__name__)
            continue
        if isinstance(spec, (list, tuple)):
            _named(tree, root, list(spec), prefix, owner)
        elif spec is True:
            _default(tree, root, prefix.rstrip("."), None, DEFAULT_SEARCH)
        else:
            _depth(tree, root, prefix.rstrip("."), None, int(spec))
    return tree


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _children(tree: Tree, module: nn.Module, prefix: str) -> Iterable[tuple[str, nn.Module]]:
    """A module's children with their paths; a compiled one is left out, named in ``tree.compiled``."""
    for name, child in module.named_children():
        path = _join(prefix, name)
        if compiled_module(child):
            tree.compiled.append(path)
        else:
            yield path, child


def _default(tree: Tree, module: nn.Module, prefix: str, parent: str | None, search: int) -> None:
    for path, child in _children(tree, module, prefix):
        blocks = _repeated(child)
        if blocks is not None:
            _blocks(tree, path, blocks, parent, sub=1)
        elif _holds_blocks(child, search):
            tree.add(child, path, parent, path)
            _default(tree, child, path, path, search - 1)
        else:
            tree.add(child, path, parent, path)


def _blocks(tree: Tree, path: str, blocks: list[tuple[str, nn.Module]], parent: str | None, sub: int) -> None:
    """Repeated blocks as one row, and ``sub`` levels of their children summed across them."""
    key = path + _span([n for n, _ in blocks])
    for _, block in blocks:
        if compiled_module(block):
            tree.compiled.append(key)
            return
    for _, block in blocks:
        tree.add(block, key, parent, key)
    if sub > 0:
        for _, block in blocks:
            for cname, child in block.named_children():
                if compiled_module(child):
                    if _join(key, cname) not in tree.compiled:
                        tree.compiled.append(_join(key, cname))
                    continue
                tree.add(child, _join(key, cname), key, _join(key, cname))


def _depth(tree: Tree, module: nn.Module, prefix: str, parent: str | None, depth: int) -> None:
    if depth <= 0:
        return
    for path, child in _children(tree, module, prefix):
        blocks = _repeated(child)
        if blocks is not None:
            key = path + _span([n for n, _ in blocks])
            _blocks(tree, path, blocks, parent, sub=0)
            for _, block in blocks if depth > 1 else ():  # each block's children under the blocks' row, summed
                _depth(tree, block, key, key, depth - 1)
        else:
            tree.add(child, path, parent, path)
            _depth(tree, child, path, path, depth - 1)


def _named(tree: Tree, root: nn.Module, names: list[str], prefix: str, owner: str) -> None:
    from phase_timer.config import _fail

    known = dict(root.named_modules())
    for name in names:
        module = known.get(name)
        if module is None or name == "":
            import difflib

            close = difflib.get_close_matches(name, [n for n in known if n], n=3)
            hint = f"; close: {', '.join(close)}" if close else f"; e.g. {', '.join(list(known)[1:4])}"
            _fail(owner, "modules", names, f"names of the model's modules (model.named_modules()){hint}",
                  f": {name!r} is not one")
        if compiled_module(module):
            tree.compiled.append(prefix + name)
            continue
        parent = next((p for p in sorted(names, key=len, reverse=True) if p != name and name.startswith(p + ".")), None)
        tree.add(module, prefix + name, prefix + parent if parent else None, name)


# -- one sampled step ------------------------------------------------------------------------------


def _graph_task() -> int:
    """-1 outside autograd's backward; else the running backward's id (a forward then is a recompute)."""
    return torch._C._current_graph_task_id()


_peek = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)


def _seq_now() -> int:
    """The sequence number autograd gives the next node it makes (thread-local, in creation order): a module's
    nodes are those numbered from its pre-hook's value to its forward hook's.  (An older torch without the peek: a
    throwaway node's number, the same counter.)"""
    if _peek is not None:
        return _peek()
    with torch.enable_grad():
        return _LEAF.view(-1).grad_fn._sequence_nr() + 1  # type: ignore[union-attr]


_LEAF = torch.zeros(0, requires_grad=True)


def _tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a module's inputs or outputs: a tensor, or inside tuples, lists and dicts (two levels)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for v in obj:
            _tensors(v, out, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out, depth + 1)
    return out


def _oldest(outs: list[Any], lo: int, hi: int) -> Any:
    """The oldest node a call made (sequence number in ``[lo, hi)``) that its output nodes reach: best first by
    sequence number (the oldest next node is followed first), done at ``lo`` itself (none can be older); else every
    reachable node of the call is seen.  ``next_functions`` builds a tuple a call, so the search sees as few nodes as
    it can: for a transformer block, its path down to its first op's node, not its ~40 nodes."""
    heap: list[tuple[int, int, Any]] = []
    n = 0
    for fn in outs:
        seq = fn._sequence_nr()
        if seq == lo:  # an output's node is the call's first (a one-op module: a norm, an embedding)
            return fn
        heap.append((seq, n, fn))
        n += 1
    heapq.heapify(heap)
    seen: set[Any] = set()
    best, oldest = None, hi
    while heap:
        seq, _, node = heapq.heappop(heap)
        if node in seen:
            continue
        seen.add(node)
        if seq < oldest:
            best, oldest = node, seq
            if seq == lo:
                return node
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                s = nxt._sequence_nr()
                if lo <= s < hi:
                    heapq.heappush(heap, (s, n, nxt))
                    n += 1
    return best


class _Call:
    """One call's backward: the nodes its forward made (``lo <= seq < hi``), its outputs' nodes; the first output
    node about to run (``begin``) and the last node done (``end``), as indices into the sample's marks."""

    __slots__ = ("key", "lo", "hi", "outs", "begin", "end")

    def __init__(self, key: str, lo: int, hi: int, outs: list[Any]) -> None:
        self.key, self.lo, self.hi, self.outs = key, lo, hi, outs
        self.begin: int | None = None
        self.end: int | None = None


class _Gate:
    """CUDA: at a sample's begin the compute stream waits on a sleep on a side stream (``torch.cuda._sleep``,
    one thread), sized per group from its last sample read (:meth:`size`), so that the kernels between its marks are
    queued before the device runs them and its marks hold device time only (see :meth:`Sample.values` for the check
    that it did)."""

    def __init__(self, clock: Any, cuda: bool = True) -> None:
        self.clock = clock
        self.device = getattr(clock, "device", None)
        # high priority: its one-thread sleep starts at once (cuda=False: the sizing alone, as the CPU tests use it)
        self.side = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        rate = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 0) if cuda else 0  # kHz: cycles a ms
        self.cycles_per_ms = float(rate) if rate else GATE_CYCLES_PER_MS
        self.ms: float | None = None  # the last length sized (a group not yet read takes it); None: none sized yet
        self.by_group: dict[int, float] = {}
        self.cap = GATE_MAX_MS  # lowered to the run's step period (with the margin) once a window is read
        self.capped = 0  # gates sized at the cap
        #: per group: its last sample's sleep, the host's ms from the gate to its last mark, and whether a mark was late
        self.last: dict[int, tuple[float, float, bool]] = {}
        #: Groups whose step waits for the device inside it (a sync, or a full launch queue): the host's time to its
        #: last mark grew with the sleep, so no gate covers them; theirs is GATE_MIN_MS from then on (their late
        #: spans are not read).
        self.futile: set[int] = set()

    def length(self, group: int, host_ms: float | None = None) -> float:
        """The sleep for ``group``'s next sample: its own sized length; else the last one sized (another group's);
        else, for the run's first, the host's time of the step before (``host_ms``, the boundaries' pilot) with the
        margin, or GATE_FIRST_MS without one."""
        if group in self.futile:
            return GATE_MIN_MS
        ms = self.by_group.get(group, self.ms)
        if ms is None:
            ms = GATE_FIRST_MS if host_ms is None else max(GATE_MIN_MS, host_ms * GATE_MARGIN + GATE_PAD_MS)
        return min(self.cap, ms)

    def hold(self, group: int, host_ms: float | None = None) -> tuple[int, Any, Any, int]:
        """Queue the gate: (host ns, the sleep's first mark, its last, cycles).  No sync: a launch and a stream wait."""
        cycles = max(1, int(self.length(group, host_ms) * self.cycles_per_ms))
        compute = torch.cuda.current_stream(self.device)
        host = time.perf_counter_ns()
        with torch.cuda.stream(self.side):
            first = self.clock.mark()
            torch.cuda._sleep(cycles)
            last = self.clock.mark()
            release = self.side.record_event()
        compute.wait_event(release)
        return host, first, last, cycles

    def size(self, group: int, slept_ms: float, need_ms: float, host_ms: float, late: bool) -> None:
        """The group's next gate, from a sample read (:meth:`Sample.values`): it slept ``slept_ms``; ``need_ms`` is the
        sleep that would have left every mark queued in time, counting as the device's own only the spans it is known
        to have run back to back (never less than what was needed; exact when every mark was in time); ``host_ms`` is
        the host's time from the gate to the sample's last mark; ``late``: a mark was queued after the device reached
        the one before.  With the margin, within [GATE_MIN_MS, the cap].  A device still busy with earlier steps (a
        GPU-bound run) leaves the need below zero: the gate shrinks to GATE_MIN_MS.

        The host's own time does not depend on the sleep, unless the host waits for the device inside the step (a
        sync, or a launch queue filled while the device sleeps): where a sleep longer by a ms or more than the
        group's last, itself late, left a mark late again and the host's time to its last mark grew by half the
        difference or more, the group is :attr:`futile`."""
        last = self.last.get(group)
        self.last[group] = (slept_ms, host_ms, late)
        if late and last is not None and last[2]:
            more = slept_ms - last[0]
            if more >= 1.0 and host_ms - last[1] >= more / 2:
                self.futile.add(group)
        want = need_ms * GATE_MARGIN + GATE_PAD_MS
        self.ms = self.by_group[group] = min(self.cap, max(GATE_MIN_MS, want))
        self.capped += want > self.cap

    def bound(self, period_ms: float) -> None:
        """No gate longer than the run's step period with the margin: within a step the host cannot fall further
        behind the device than the step's own time (the margin is for the hooks' host time), and a longer sleep would
        only be waited for (a sync inside the step waits for it, whatever its length)."""
        if period_ms > 0:
            self.cap = min(GATE_MAX_MS, max(GATE_MIN_MS, period_ms * GATE_MARGIN + GATE_PAD_MS))

    def calibrate(self, slept_ms: float, cycles: int) -> None:
        """The SM clock's rate from a sleep's measured length (the device's clock moves with its boost)."""
        if slept_ms > 0.05:
            self.cycles_per_ms = cycles / slept_ms


def _hook(sample: Sample, body: Callable[..., None]) -> Callable[..., None]:
    """One of ``sample``'s two forward hooks, over ``body`` (a :class:`Sample` method, unbound): its host time
    counted in the sample's (``host_ns``), and a failure kept (``Sample.fail``: the measure stops at the step's
    close), never raised into the model's forward.  A plain function, not a bound method: a deepcopy of a hooked
    module taken on a sampled step (an EMA copy) shares it, where a bound method would be copied with its sample and
    the sample's autograd nodes, which cannot be copied; the copy's calls are no row's (``Sample.keys``)."""

    def hook(module: nn.Module, *args: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            body(sample, module, *args)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            sample.fail(err)
        sample.host_ns += time.perf_counter_ns() - t0

    return hook


class Sample:
    """One sampled step's hooks and marks, until its marks are read.

    It hooks one group of the tree's rows (``keys``; :meth:`Tree.groups`) and marks each hooked module's forward and
    backward; with ``read`` (CUDA: the allocator's counters, on a group's first sample and one in ``ACT_EVERY``) it
    also reads the allocator before each forward's first mark and after its last (activations)."""

    def __init__(self, measure: ModuleTimes, step: int, part: int = 0, keys: Iterable[str] | None = None,
                 read: Callable[[], int] | None = None) -> None:
        self.m = measure
        self.step = step
        self.part = part  # the group of rows hooked (an index into the measure's groups)
        self.rows = None if keys is None else frozenset(keys)  # None: every row
        self.read = read
        self.reads = 0  # allocator reads taken
        self.handles: list[Any] = []
        self.direct: list[tuple[dict, dict, dict, int]] = []  # the hooks put straight into modules' dicts
        self.keys: dict[int, str] = {}  # id(module) -> its row, while the hooks are on
        self.stack: list[tuple[int, int, int, int, int]] = []  # id(module), mark, seq at its begin, task, allocated
        self.forward: list[tuple[str, int, int]] = []  # row, first mark, last mark (indices into marks)
        self.recompute: list[tuple[str, int, int]] = []
        self.calls: list[_Call] = []
        self.nest: list[_Call] = []  # the calls under the outermost hooked call running now
        self.activation: dict[str, float] = {}
        self.marks: list[Any] = []  # every mark taken, in order
        self.host: list[int] = []  # the host's ns at each mark
        self.gate: tuple[int, Any, Any, int] | None = None
        self.epoch: int | None = None  # the clock's stream epoch at the first mark; None: not yet
        self.moved = False  # marks went to another stream mid-sample: the gate's check cannot be made
        self.host_ns = 0
        self.nodes = 0  # autograd node hooks put on
        self.failed: str | None = None
        self.uncovered = 0  # spans the gate did not cover (not read)

    # hooks -------------------------------------------------------------------------------------
    def install(self, tree: Tree) -> None:
        """Two hooks a module of the sample's rows, one pair of functions for all (no closure a module).  They go
        straight into the module's hook dicts, as ``register_forward_pre_hook`` /
        ``register_forward_hook(always_call=True)`` put them, without a handle each (a handle's making and removal
        are most of a registration's ~2 µs); a module without those dicts (another torch) gets the public
        registration."""
        cls = type(self)
        pre, post = _hook(self, cls._pre), _hook(self, cls._post)
        for module, key in tree.modules(self.rows):
            self.keys[id(module)] = key
            pres, posts = getattr(module, "_forward_pre_hooks", None), getattr(module, "_forward_hooks", None)
            always = getattr(module, "_forward_hooks_always_called", None)
            if isinstance(pres, dict) and isinstance(posts, dict) and isinstance(always, dict):
                first = RemovableHandle.next_id
                RemovableHandle.next_id += 2
                pres[first] = pre
                posts[first + 1] = post
                always[first + 1] = True
                self.direct.append((pres, posts, always, first))
            else:
                self.handles.append(module.register_forward_pre_hook(pre))
                self.handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        for pres, posts, always, first in self.direct:
            pres.pop(first, None)
            posts.pop(first + 1, None)
            always.pop(first + 1, None)
        self.direct = []
        for h in self.handles:
            h.remove()
        self.handles = []
        self.stack = []
        self.nest = []
        self.keys = {}

    def _mark(self) -> int:
        clock = self.m.clock
        self.marks.append(clock.mark())
        self.host.append(time.perf_counter_ns())
        epoch = clock.stream_epoch
        if self.epoch is None:
            self.epoch = epoch
        elif epoch != self.epoch:
            self.moved = True
        return len(self.marks) - 1

    # forward: the allocator read (when the sample reads it), a mark at each end, the seq counter; the node hooks at
    # the outermost call's end
    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.keys:  # a hooked module's call (a copy of one carries the hook, not the row)
            read = self.read
            before = 0
            if read is not None:
                before = read()
                self.reads += 1
            self.stack.append((id(module), self._mark(), _seq_now(), _graph_task(), before))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self.stack
        if not stack or stack[-1][0] != id(module):  # a call whose pre-hook failed, or an odd nesting: skip it
            return
        _, begin, lo, task, before = stack.pop()
        end = self._mark()
        key = self.keys[id(module)]
        if task != -1:  # inside a backward: checkpointing's recompute, never forward's (nor its allocations)
            self.recompute.append((key, begin, end))
            return
        read = self.read
        if read is not None:
            self.activation[key] = self.activation.get(key, 0.0) + (read() - before) / MB
            self.reads += 1
        self.forward.append((key, begin, end))
        if torch.is_grad_enabled():
            hi = _seq_now()
            outs: list[Any] = []
            for t in _tensors(output, []):
                fn = t.grad_fn
                if fn is not None and lo <= fn._sequence_nr() < hi and fn not in outs:
                    outs.append(fn)
            if outs:
                self.nest.append(_Call(key, lo, hi, outs))
        if not stack and self.nest:  # the outermost hooked call ended: its backward hooks and every call's under it
            nest, self.nest = self.nest, []
            self._backward_hooks(nest)

    def _backward_hooks(self, nest: list[_Call]) -> None:
        """A pre-hook on each call's output nodes (its backward begins) and a post-hook on its *oldest* node (its
        backward ends there): autograd runs a device's ready nodes newest first (its ready queue is ordered by the
        sequence number), and every node of the call waits only on newer ones (its own, or the consumers of the
        call's outputs), so on one device the call's oldest node runs after all of its others.  A node shared by
        nested calls carries one hook and one mark for all of them.  The oldest is found by :func:`_oldest`, a search
        that follows the oldest next node first and stops at the call's first sequence number: a path through the
        graph, not a walk of all of it."""
        starts: dict[Any, list[_Call]] = {}
        lasts: dict[Any, list[_Call]] = {}
        for call in nest:
            for fn in call.outs:
                starts.setdefault(fn, []).append(call)
            node = _oldest(call.outs, call.lo, call.hi)
            if node is not None:
                lasts.setdefault(node, []).append(call)
            # The sample keeps no node: the graph is freed when the step lets go of it, as without a sample (and a
            # node's hook, holding the call, never holds the node back through it).
            call.outs = []
        handles = self.handles
        for node, calls in starts.items():
            handles.append(node.register_prehook(self._begins(calls)))
        for node, calls in lasts.items():
            handles.append(node.register_hook(self._ends(calls)))
        self.nodes += len(starts) + len(lasts)
        self.calls.extend(nest)

    def _begins(self, calls: list[_Call]) -> Callable[[Any], None]:
        def begins(grad_outputs: Any) -> None:
            try:
                todo = [c for c in calls if c.begin is None]
                if todo:
                    mark = self._mark()
                    for c in todo:
                        c.begin = mark
            except Exception as err:  # noqa: BLE001 - autograd's hook: the timer must never break backward
                self.fail(err)

        return begins

    def _ends(self, calls: list[_Call]) -> Callable[[Any, Any], None]:
        def ends(grad_inputs: Any, grad_outputs: Any) -> None:
            try:
                mark = self._mark()
                for c in calls:
                    c.end = mark
            except Exception as err:  # noqa: BLE001 - as above
                self.fail(err)

        return ends

    def fail(self, err: Exception) -> None:
        if self.failed is None:
            self.failed = f"{type(err).__name__}: {err}"

    # results -----------------------------------------------------------------------------------
    def _all(self) -> list[Any]:
        return ([self.gate[1], self.gate[2]] if self.gate is not None else []) + self.marks

    def done(self) -> bool:
        """Every mark done: on one stream they complete in order, so the last one's query says; else each."""
        marks = self._all()
        if not marks:
            return True
        done = self.m.clock.done
        return done(marks[-1]) if not self.moved else all(done(m) for m in marks)

    def values(self) -> dict[str, dict[str, float]]:
        """Per row: forward_ms, backward_ms (when its backward ran), recompute_ms, activation_mb, calls.

        With a gate, a span is read only where the device never waited for the host inside it: each of its marks
        was queued before the device reached the mark before it.  The device reached mark ``i-1`` at ``t[i-1]``
        after the gate's sleep began, and the sleep began after the host queued it (``host[gate]``), so a mark
        queued at ``host[i] - host[gate] <= t[i-1]`` (host ms) was queued before: everything between the two marks
        was waiting for the device, which ran it back to back (a sufficient condition, whatever the launch
        latency).  A span that fails it is not read (``uncovered``), and neither is the rest of its row's phase in
        this sample: a row's value is a step's, all of its calls or none (a part would read short).  The sleep the
        sample needed sizes the group's next gate (:meth:`_Gate.size`)."""
        out: dict[str, dict[str, float]] = {}
        marks = self._all()
        if not marks:
            return self._activations(out)
        spans = self.m.clock.spans(marks)
        t = [0.0]
        for s in spans:
            t.append(t[-1] + s)
        base, bad, slept = 0, None, None
        if self.gate is not None:
            base = 2
            gated = not self.moved
            host0 = self.gate[0]
            bad = [0]  # bad[i]: spans into marks 0..i-1 the gate did not cover, summed
            # need: the sleep that would have covered every mark.  Mark i needs the host's ms to it less the device's
            # own time from the sleep's end to mark i-1; of that, only the spans known to have run back to back (a
            # covered mark's span) are counted (``busy``): an uncovered span holds the device's wait for the host, so
            # counting it would size the next sleep short by that wait.
            need, busy, late, hm = float("-inf"), 0.0, False, 0.0
            for i, h in enumerate(self.host):
                hm = (h - host0) / 1e6
                if hm - busy > need:
                    need = hm - busy
                room = t[base + i - 1] - hm
                if room >= 0:
                    busy += t[base + i] - t[base + i - 1]
                else:
                    late = True
                bad.append(bad[-1] + (gated and room < 0))
            slept = t[1] - t[0]
            gate = self.m.gate
            if gate is not None:
                gate.calibrate(slept, self.gate[3])
                if gated and self.host:
                    gate.size(self.part, slept, need, hm, late)

        def ms(a: int, b: int) -> float | None:
            if bad is not None and bad[b + 1] - bad[a + 1]:
                self.uncovered += 1
                return None
            return t[base + b] - t[base + a]

        got: dict[tuple[str, str], float | None] = {}  # (row, phase) -> the sum of its calls; None: one uncovered
        calls: dict[str, float] = {}

        def add(key: str, phase: str, v: float | None) -> None:
            had = got.get((key, phase), 0.0)
            got[key, phase] = None if had is None or v is None else had + v

        for key, a, b in self.forward:
            add(key, "forward_ms", ms(a, b))
            calls[key] = calls.get(key, 0.0) + 1
        for call in self.calls:
            if call.begin is not None and call.end is not None:
                v = ms(call.begin, call.end)
                add(call.key, "backward_ms", None if v is None else max(0.0, v))
        for key, a, b in self.recompute:
            add(key, "recompute_ms", ms(a, b))
        for (key, phase), v in got.items():
            if v is not None:
                row = out.setdefault(key, {})
                row[phase] = v
                if phase == "forward_ms":
                    row["calls"] = calls[key]
        return self._activations(out)

    def _activations(self, out: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for key, mb in self.activation.items():
            out.setdefault(key, {})["activation_mb"] = mb
        return out

    def release(self) -> None:
        self.m.clock.release(self._all())
        self.marks = []
        self.gate = None


# -- the measure ------------------------------------------------------------------------------------


class _Stat:
    __slots__ = ("n", "total", "raw")

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.raw: list[float] = []

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v
        self.raw.append(v)
        if len(self.raw) > RAW_KEPT:
            del self.raw[0]

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


class ModuleTimes(Measure):
    """Per module of the model: forward and backward time and activations, on sampled steps (see the module).

    The boundaries call :meth:`begin` when a step at or after :attr:`next_due` begins (a plain step, past the
    warm-up), and :meth:`close` (or :meth:`drop`) when it closes; the core hears the results as any measure."""

    key = "modules"

    def __init__(self, models: Iterable[nn.Module], spec: Any = True, *, clock: Any,
                 allocated: Callable[[], int] | None = None, warmup_steps: int = 0, owner: str = "attach",
                 dense: int = DENSE, gate: bool = False) -> None:
        self.spec = spec
        self.clock = clock
        #: The allocator's allocated bytes now (no sync); None: activations are not measured (the CPU).
        self.allocated = allocated
        #: CUDA: the gate that holds a sample's kernels until the host has queued them (None: the host clock).
        self.gate: _Gate | None = _Gate(clock) if gate else None
        self.uncovered = 0  # spans a gate did not cover (not read)
        self.nodes = 0  # autograd node hooks put on, over the samples
        self.tree = build_tree(list(models), spec, owner)  # the models are not kept: the tree holds its modules weakly
        #: The groups of rows a sample hooks, in turn (:meth:`Tree.groups`); per group, its samples taken (a dropped
        #: step's is taken again next), those read with every span covered (or on a step where none of its modules
        #: ran), and those read that read the allocator.
        self.groups = self.tree.groups()
        self._visits = [0] * len(self.groups)
        self._clean = [0] * len(self.groups)
        self._acts = [0] * len(self.groups)
        self._rng = random.Random(SEED)
        self._next = warmup_steps + 2  # steps begun, 1-based: past the warm-up and its first timed step
        self._dense = 0
        # steps sampled DENSE_GAP apart before the sparse gap: enough for every group once
        self._dense_n = max(dense, len(self.groups) - 1) if dense > 0 else 0
        self.sample: Sample | None = None
        self._pending: list[Sample] = []
        self._pilot: tuple[int, int] | None = None  # (steps begun, host ns) at the step before a sample's begin
        self.samples = 0  # read
        self.dropped = 0
        self.stats: dict[str, dict[str, _Stat]] = {}
        self._window: dict[str, dict[str, float]] = {}  # the rows read since the last window (the latest of each)
        self._tags: dict[str, str] = {}  # a row's scalars' prefix
        #: Host time spent on samples (hooks, search, marks, registration) and the steps begun, for the cost.
        self.own_ns = 0
        self.steps_begun = 0
        self.failed: str | None = None
        self.ended = False  # the run's end was heard (`end`): the verdict reads the block from then on
        self.shares: dict[str, dict[str, float]] = {}
        self._phase_ms: dict[str, float] = {}

    @property
    def active(self) -> bool:
        """Anything to hook (not turned off, not a compiled model)."""
        return bool(self.tree.targets) and self.failed is None

    @property
    def untimed(self) -> bool:
        """A sampled step is left out of the phases' statistics (the device's clock: a sample holds the gate, and
        may read the allocator in the step).  On the host clock it stays timed."""
        return getattr(self.clock, "kind", None) == "cuda"

    @property
    def next_due(self) -> int:
        """The step (begun, 1-based) to sample next (a very large number: never)."""
        return self._next if self.active else 1 << 62

    # -- the boundaries ---------------------------------------------------------------------------
    def begin(self, begun: int, step: int) -> bool:
        """A sampled step begins: the next group's hooks on (the group with the fewest samples kept, the first
        such).  False: not sampled (failed)."""
        t0 = time.perf_counter_ns()
        if self._pending:  # what is done is read now (a query each): the gate is sized from the freshest
            self._read()
        visits = self._visits
        part = self._next_part()
        self._schedule(begun)
        read = self.allocated if self.allocated is not None and visits[part] % ACT_EVERY == 0 else None
        visits[part] += 1
        sample = Sample(self, step, part, self.groups[part], read)
        pilot, self._pilot = self._pilot, None
        host_ms = (t0 - pilot[1]) / 1e6 if pilot is not None and pilot[0] == begun - 1 else None
        try:
            sample.install(self.tree)
            if self.gate is not None:
                sample.gate = self.gate.hold(part, host_ms)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            sample.remove()
            self._fail(err)
            return False
        self.sample = sample
        self.own_ns += time.perf_counter_ns() - t0
        return True

    def pilot(self, begun: int) -> None:
        """The step before a sample has begun (the boundaries call it where a gate is sized): its host time, read at
        the sample's begin, sizes the run's first gate (:meth:`_Gate.length`)."""
        self._pilot = (begun, time.perf_counter_ns())

    def _unread(self) -> list[int]:
        """Groups with no sample read whole, none waiting to be read, and a gate that can cover them (not futile)."""
        waiting = {s.part for s in self._pending}
        acts = self._acts if self.allocated is not None else self._clean
        futile = self.gate.futile if self.gate is not None else ()
        return [g for g, (n, a) in enumerate(zip(self._clean, acts))
                if not (n and a) and g not in waiting and g not in futile]

    def _next_part(self) -> int:
        """The group a sample hooks: of those with no sample read whole (none waiting, not futile), the one with the
        fewest samples taken; else the one with the fewest (the first such)."""
        visits = self._visits
        unread = self._unread()
        if unread:
            return min(unread, key=visits.__getitem__)
        return visits.index(min(visits))

    def _schedule(self, begun: int) -> None:
        """The next sample's step: DENSE_GAP on while the dense samples last, then the sparse gap from the seeded
        generator.  It never depends on what was read, so that every rank of a distributed run samples the same steps
        (a rank's gate holds its collectives: on a step its peers time, their waits would hold it)."""
        if self._dense < self._dense_n:
            self._dense += 1
            self._next = begun + DENSE_GAP
        else:
            self._next = begun + self._rng.randint(*GAP)

    def close(self, recorded: bool) -> None:
        """The sampled step closed (``recorded``: its phases were timed): hooks off, its marks wait to be read."""
        t0 = time.perf_counter_ns()
        sample, self.sample = self.sample, None
        if sample is None:
            return
        sample.remove()
        self.nodes += sample.nodes
        if sample.failed is not None:
            self._fail(RuntimeError(sample.failed))
        if recorded and sample.failed is None and (sample.forward or sample.activation):
            self._pending.append(sample)
        else:
            self.dropped += 1
            if recorded and sample.failed is None:  # none of its modules ran on this step: nothing to read
                self._clean[sample.part] += 1
                self._acts[sample.part] += 1
            else:
                self._visits[sample.part] -= 1  # not a training step's: its group is taken again next
            sample.release()
        self.own_ns += time.perf_counter_ns() - t0 + sample.host_ns

    def drop(self) -> None:
        """The step was dropped or paused: what its hooks measured is not a training step's."""
        self.close(False)

    def _fail(self, err: Exception) -> None:
        self.failed = f"{type(err).__name__}: {err}"
        warn(log, f"phase-timer: modules are no longer measured ({self.failed}); the time phases go on", 4)

    def _read(self, final: bool = False) -> None:
        """The pending samples whose marks are all done (a query each; never a wait): folded in, and their rows kept
        for the next window's scalars."""
        keep = []
        for sample in self._pending:
            if not sample.done():
                if not final:
                    keep.append(sample)
                else:
                    sample.release()
                continue
            vals = sample.values()
            self.uncovered += sample.uncovered
            sample.release()
            self.samples += 1
            self._clean[sample.part] += not sample.uncovered
            self._acts[sample.part] += sample.read is not None
            for key, row in vals.items():
                stats = self.stats.setdefault(key, {})
                for name, v in row.items():
                    stats.setdefault(name, _Stat()).add(v)
            self._window.update(vals)
        self._pending = keep

    # -- Measure -----------------------------------------------------------------------------------
    def window(self, columns: dict[str, list[float]]) -> dict[str, float]:
        t0 = time.perf_counter_ns()
        if self.gate is not None and columns.get("period"):
            period = columns["period"]  # sorted
            self.gate.bound(period[len(period) // 2])
        if self._pending:
            self._read()
        out: dict[str, float] = {}
        tags = self._tags
        for key, row in self._window.items():
            tag = tags.get(key)
            if tag is None:
                tag = tags[key] = f"{PREFIX}/{tag_key(key)}/"
            for name in ("forward_ms", "backward_ms", "recompute_ms", "activation_mb"):
                if name in row:
                    out[tag + name] = row[name]
        self._window = {}
        self.own_ns += time.perf_counter_ns() - t0
        return out

    def end(self, totals: Any) -> list[str]:
        self._read(final=True)
        phases = getattr(totals, "phases", {}) or {}
        for phase in ("forward", "backward"):
            t = phases.get(phase)
            if t is not None and t.mean:
                self._phase_ms[phase] = t.mean
        self.steps_begun = getattr(totals, "steps", 0) or self.steps_begun
        self.ended = True
        return []

    def verdict(self) -> dict[str, Any]:
        """What the verdict's rules read (``diagnose``'s ``modules``): the summary block, at the run's end only.
        Before it the shares of the run's phases are not known, and the live file's thread would walk the
        statistics the training thread fills: the verdict so far goes without it."""
        return {"modules": self.summary()} if self.ended else {}

    def rows(self) -> dict[str, dict[str, Any]]:
        """Per row, in the tree's order: means over the samples, shares of the run's phases, kind and parent."""
        out: dict[str, dict[str, Any]] = {}
        for key, entry in self.tree.entries.items():
            stats = self.stats.get(key)
            if not stats:
                continue
            row: dict[str, Any] = {"kind": entry.kind, "parent": entry.parent, "modules": entry.modules}
            for name in ("forward_ms", "backward_ms", "recompute_ms", "activation_mb", "calls"):
                s = stats.get(name)
                row[name] = s.mean if s is not None else None
            for phase in ("forward", "backward"):
                v, base = row[f"{phase}_ms"], self._phase_ms.get(phase)
                row[f"share_of_{phase}"] = v / base if v is not None and base else None
            row["samples"] = stats["calls"].n if "calls" in stats else 0
            row["raw"] = {n: list(s.raw) for n, s in stats.items() if n != "calls"}
            out[key] = row
        return out

    def leaves(self, rows: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The rows no other row is under: the most specific ones (their sum never counts a time twice)."""
        rows = self.rows() if rows is None else rows
        parents = {r["parent"] for r in rows.values()}
        return {k: r for k, r in rows.items() if k not in parents}

    def host_cost(self) -> dict[str, float] | None:
        """Host time: a sampled step's (ms), and a step's amortized (µs); None before a sample.  (The summary
        block's ``cost``; not :meth:`Measure.cost`, whose keywords are the own-cost line's.)"""
        n = self.samples + self.dropped
        if not n:
            return None
        per = self.own_ns / n / 1e6
        out = {"sampled_step_ms": per, "us_per_step": per * 1e3 / (GAP_MEAN if n > self._dense_n else max(1, DENSE_GAP))}
        if self.gate is not None:  # spans the gate did not cover (not read), and the gate's last length
            out["uncovered"] = float(self.uncovered)
            out["gate_ms"] = self.gate.ms
            out["gates_capped"] = float(self.gate.capped)
            out["gates_futile"] = float(len(self.gate.futile))
        return out

    def groups_read(self) -> int:
        """Groups of rows with a sample read whole (every span covered; on CUDA one that read the allocator too)."""
        acts = self._acts if self.allocated is not None else self._clean
        return sum(1 for n, a in zip(self._clean, acts) if n and a)

    @property
    def complete(self) -> bool:
        """Every group of rows has a sample read whole: every row that ran has its figures (the verdict names a
        module only then: a part of the table could name the largest of what was read, not the largest)."""
        return self.groups_read() == len(self.groups)

    def note(self) -> str | None:
        """Why some or all modules are not measured (None: nothing to say)."""
        t = self.tree
        if t.whole_compiled and not t.targets:
            return f"not measured: the model is compiled (torch.compile); {NOT_COMPILED_NOTE}"
        if t.compiled:
            return f"not measured: {', '.join(t.compiled[:4])}{' ...' if len(t.compiled) > 4 else ''} (compiled); " + \
                NOT_COMPILED_NOTE
        if self.failed is not None:
            return f"stopped: {self.failed}"
        return None

    def line(self) -> str | None:
        note = self.note()
        rows = self.leaves()
        if not rows:
            if note is not None:
                return f"modules: {note}"
            return None if self.spec is False else "modules: no sampled step was read (too few steps)"
        parts = []
        for phase in ("forward", "backward"):
            top = sorted(((r[f"{phase}_ms"], k) for k, r in rows.items() if r[f"{phase}_ms"] is not None),
                         reverse=True)[:TABLE_TOP]
            shown = ", ".join(f"{k} {v:.2f} ms" + (f" ({_pct(rows[k][f'share_of_{phase}'])})"
                                                   if rows[k][f"share_of_{phase}"] is not None else "")
                              for v, k in top)
            if shown:
                parts.append(f"{phase}: {shown}")
        read = "" if self.complete else f", {self.groups_read()} of {len(self.groups)} groups of rows read"
        text = f"modules ({self.samples} sampled steps{read}, inclusive): " + "; ".join(parts)
        act = sorted(((r["activation_mb"], k) for k, r in rows.items() if r["activation_mb"] is not None), reverse=True)
        if act:
            text += "; activations: " + ", ".join(f"{k} {v:.0f} MB" for v, k in act[:TABLE_TOP])
        if note is not None:
            text += f"; {note}"
        return text

    def summary(self) -> dict[str, Any] | None:
        if self.spec is False:
            return None
        rows = self.rows()
        cost = self.host_cost()
        return {
            "spec": self.spec if not isinstance(self.spec, tuple) else list(self.spec),
            "clock": getattr(self.clock, "kind", None),
            "samples": self.samples,
            "dropped": self.dropped,
            "groups": len(self.groups),
            "groups_read": self.groups_read(),
            "complete": self.complete,
            "activations": "measured" if self.allocated is not None else "not measured: no allocator counters on the host clock",
            "inclusive": True,
            "rows": rows,
            "leaves": sorted(self.leaves(rows)),
            "compiled": list(self.tree.compiled),
            "note": self.note(),
            "cost": cost,
        }


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def make(models: Sequence[nn.Module], spec: Any, clock: Any, *, warmup_steps: int, owner: str) -> ModuleTimes | None:
    """The measure for a run (None: ``modules=False`` or no model).  On CUDA, activations from the allocator's
    counters (``torch._C._cuda_memoryStats``: no sync); a separate instance of the run's clock, so that the core's
    stream bookkeeping never sees a module's mark."""
    if spec is False or not models:
        return None
    allocated = None
    own_clock = clock
    cuda = getattr(clock, "kind", None) == "cuda"
    if cuda:
        from phase_timer.measures.memory import cuda_reader

        index = clock.device.index
        reader = cuda_reader(index)
        allocated = lambda: reader().allocated  # noqa: E731
        own_clock = type(clock)(clock.device)
    dense = DENSE if getattr(clock, "kind", None) != "host" else HOST_DENSE
    return ModuleTimes(models, spec, clock=own_clock, allocated=allocated, warmup_steps=warmup_steps, owner=owner,
                       dense=dense, gate=cuda and GATE)


__all__ = ["ModuleTimes", "Tree", "build_tree", "check_modules", "make"]
