"""Which module's sampled step: the hooks one group of rows gets for a step, their marks in forward and backward,
the allocator's reads, and what they read once done (:class:`Sample`)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from phase_timer.measures.modules.tree import Tree

#: Bytes a MiB (the activations' unit).
MB = float(1 << 20)

#: On a device's clock, a call's backward end moves past the gradient sums autograd makes after its oldest node
#: (:meth:`Sample._after`) only where a parameter's node it feeds runs within this many host ns of that node's end:
#: the engine runs a parameter's node it made ready next, after launching the sums (tens of µs); one that waits for
#: another gradient runs behind other nodes' evaluations.
AFTER_NS = 200_000

#: A parameter's node (AccumulateGrad), by type (a node of a custom Function may have a ``variable`` of its own).
_ACCUMULATE = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def _is_param_node(node: Any) -> bool:
    return isinstance(node, _ACCUMULATE) if _ACCUMULATE is not None else hasattr(node, "variable")


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
    """One call's backward: the nodes its forward made (``lo <= seq < hi``), its outputs' nodes, its inputs' nodes
    (on a device's clock: the nodes its gradients for its inputs feed); the first output node about to run (``begin``)
    and its backward's end (``end``: after its oldest node, :meth:`Sample._after`), as indices into the sample's
    marks."""

    __slots__ = ("key", "lo", "hi", "outs", "ins", "begin", "end")

    def __init__(self, key: str, lo: int, hi: int, outs: list[Any], ins: list[Any] | None = None) -> None:
        self.key, self.lo, self.hi, self.outs, self.ins = key, lo, hi, outs, ins or []
        self.begin: int | None = None
        self.end: int | None = None


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

    def __init__(self, measure: Any, step: int, part: int = 0, keys: Iterable[str] | None = None,
                 read: Callable[[], int] | None = None) -> None:
        self.m = measure  # the ModuleTimes that took the sample (times.py imports this module, not the reverse)
        self.step = step
        self.part = part  # the group of rows hooked (an index into the measure's groups)
        self.rows = None if keys is None else frozenset(keys)  # None: every row
        self.read = read
        self.reads = 0  # allocator reads taken
        self.handles: list[Any] = []
        self.direct: list[tuple[dict, dict, dict, int]] = []  # the hooks put straight into modules' dicts
        self.keys: dict[int, str] = {}  # id(module) -> its row, while the hooks are on
        #: id(module), mark, seq at its begin, task, allocated, its inputs' nodes (a device's clock; else None)
        self.stack: list[tuple[int, int, int, int, int, list[Any] | None]] = []
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
        #: A device's clock: a call's backward end may move past autograd's sums (:meth:`_after`); on the host's
        #: clock the sums run inline, between the hooks, and a later end would hold the host's own work for them.
        self.device = getattr(measure.clock, "kind", None) != "host"
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
            ins = [t.grad_fn for t in _tensors(args, []) if t.grad_fn is not None] if self.device else None
            self.stack.append((id(module), self._mark(), _seq_now(), _graph_task(), before, ins))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self.stack
        if not stack or stack[-1][0] != id(module):  # a call whose pre-hook failed, or an odd nesting: skip it
            return
        _, begin, lo, task, before, ins = stack.pop()
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
                self.nest.append(_Call(key, lo, hi, outs, ins))
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
        graph, not a walk of all of it.  On a device's clock, a pre-hook too on each parameter's node (AccumulateGrad)
        the oldest node feeds, and on each node of its inputs: the first parameter's node to run, unless one of the
        inputs' nodes ran first, moves the end past the engine's sums (:meth:`_after`)."""
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
        n = len(starts)
        for node, calls in lasts.items():
            params = [nxt for nxt, _ in node.next_functions if nxt is not None and _is_param_node(nxt)] \
                if self.device else []
            state: list[Any] | None = [None, 0] if params else None
            handles.append(node.register_hook(self._ends(calls, state)))
            n += 1
            if state is not None:
                for nxt in params:
                    handles.append(nxt.register_prehook(self._after(calls, state)))
                ins = {i for c in calls for i in c.ins} - set(params)
                for i in ins:
                    handles.append(i.register_prehook(self._close(state)))
                n += len(params) + len(ins)
        for call in nest:
            call.ins = []  # as the outputs' nodes: none kept
        self.nodes += n
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

    def _ends(self, calls: list[_Call], state: list[Any] | None) -> Callable[[Any, Any], None]:
        """The post-hook on the calls' oldest node: their end mark (into ``state`` too, with its host ns, where the
        node feeds parameters' nodes: :meth:`_after`)."""

        def ends(grad_inputs: Any, grad_outputs: Any) -> None:
            try:
                mark = self._mark()
                for c in calls:
                    c.end = mark
                if state is not None:
                    state[0], state[1] = mark, self.host[mark]
            except Exception as err:  # noqa: BLE001 - as above
                self.fail(err)

        return ends

    def _after(self, calls: list[_Call], state: list[Any]) -> Callable[[Any], None]:
        """The pre-hook on a parameter's node (AccumulateGrad) that the calls' oldest node feeds: the first of them
        to run moves the calls' end past what autograd's engine did after that node's post-hook, in the same node's
        evaluation -- the sums of its gradients into the buffers of the nodes they feed (a tied weight's two
        gradients, a residual's input gradient): the profiler counts them in the node's evaluation, and they are
        the call's gradient for its inputs and parameters.  The engine runs a ready parameter's node before any
        other (the highest priority), so one that the oldest node made ready runs right after it, once the sums are
        launched; one that waits for another gradient (a weight shared with an op that ran earlier in forward: a
        tied head's) runs after that op's backward, and after the nodes of the call's inputs, which the engine
        runs next where they are ready (:meth:`_close`).  So the end moves only where no mark was taken since it, no
        node of the call's inputs ran since, and the parameter's node runs within AFTER_NS of it (on a device's clock
        alone: :meth:`_backward_hooks`).  A parameter's own tensor hooks (``register_hook`` on it) run before this
        pre-hook: their work is in the call's backward."""

        def after(grad_outputs: Any) -> None:
            try:
                end = state[0]
                if end is None:
                    return
                state[0] = None  # the first parameter's node to run, alone
                if end != len(self.marks) - 1 or time.perf_counter_ns() - state[1] > AFTER_NS:
                    return
                mark = self._mark()
                for c in calls:
                    c.end = mark
            except Exception as err:  # noqa: BLE001 - as above
                self.fail(err)

        return after

    def _close(self, state: list[Any]) -> Callable[[Any], None]:
        """The pre-hook on a node of the calls' inputs: it ran after their oldest node and before any parameter's
        node that node feeds, which then waits for another gradient: the end stays (:meth:`_after`)."""

        def close(grad_outputs: Any) -> None:
            state[0] = None

        return close

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
