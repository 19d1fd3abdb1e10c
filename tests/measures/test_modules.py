"""Which module (``phase_timer/measures/modules/``), on the CPU: planted modules named and measured on the host
clock, the tree (repeated blocks, nesting, shared weights), checkpointing, a compiled model, the sampled steps (the
ordinary step carries no hook), and every door writing the module rows."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import phase_timer
from phase_timer.measures import modules as mod
from phase_timer.measures.modules import ModuleTimes, build_tree
from phase_timer.measures.modules import times as mod_times
from phase_timer.measures.modules import tree as mod_tree
from phase_timer.timing.clock import HostClock
from tests import helpers
from tests.helpers import hours, read_scalars

SLEEP_S = 0.005


@pytest.fixture(autouse=True)
def _dense_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """These short CPU runs sample densely, as a device run does (the host clock's default is sparse only: a sampled
    step's hooks are in its host-clock phases)."""
    monkeypatch.setattr(mod_times, "HOST_DENSE", mod.DENSE)  # where the schedule reads it


class Planted:
    """What a planted module measured of itself: its sleep, from just before to just after (ms), per step; and its
    whole forward and backward, its own ops with the sleep (ms, per call)."""

    def __init__(self) -> None:
        self.forward_ms: list[float] = []
        self.backward_ms: list[float] = []
        self.forward_body_ms: list[float] = []
        self.backward_spans: list[list[int]] = []  # a backward's [start ns, its last gradient's ns]

    @property
    def backward_body_ms(self) -> list[float]:
        return [(end - start) / 1e6 for start, end in self.backward_spans if end]


class SleepyForward(nn.Module):
    """A forward that sleeps 5 ms (and times its own sleep)."""

    def __init__(self, planted: Planted) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        _sleep(self.planted.forward_ms)
        out = self.lin(x)
        self.planted.forward_body_ms.append((time.perf_counter_ns() - t0) / 1e6)
        return out


def _sleep(into: list[float]) -> None:
    """Sleep 5 ms, and keep how long it took (ms) in ``into``."""
    t0 = time.perf_counter_ns()
    helpers.pause(SLEEP_S)
    into.append((time.perf_counter_ns() - t0) / 1e6)


class _OnBackward(torch.autograd.Function):
    """The identity, which calls ``then()`` in its backward: a module's planted backward work."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, then: Any) -> torch.Tensor:
        ctx.then = then
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.then()
        return grad * 1.0, None


class SleepyBackward(SleepyForward):
    """A module whose custom autograd Function sleeps 5 ms in backward (and its forward does not).  Its whole
    backward, timed by itself: from its Function's backward to the last gradient for its input and parameters."""

    def __init__(self, planted: Planted) -> None:
        super().__init__(planted)
        for p in self.lin.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: self._stamp())

    def _stamp(self) -> None:
        if self.planted.backward_spans:
            self.planted.backward_spans[-1][1] = time.perf_counter_ns()

    def _begin(self) -> None:
        self.planted.backward_spans.append([time.perf_counter_ns(), 0])
        _sleep(self.planted.backward_ms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x.register_hook(lambda _g: self._stamp())  # its input's gradient
        return _OnBackward.apply(self.lin(x), self._begin)


class Net(nn.Module):
    def __init__(self, planted: Planted) -> None:
        super().__init__()
        self.slow_fwd = SleepyForward(planted)
        self.slow_bwd = SleepyBackward(planted)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.slow_bwd(self.slow_fwd(x)))


def batches(n: int, width: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, width, generator=g) for _ in range(n)]


def train(model: nn.Module, n: int = 30, width: int = 8, tmp: Any = None, **kwargs: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kwargs.setdefault("warmup_steps", 2)
    kwargs.setdefault("window", 5)
    kwargs.setdefault("modules", True)  # opt-in (off by default)
    timer = phase_timer.attach(model, opt, batches(n, width), summary=False,
                               log_dir=str(tmp) if tmp is not None else None, **kwargs)
    with timer:
        for x in timer.loader:
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return timer


def summary(timer: Any) -> dict:
    with open(os.path.join(timer.log_dir, "phase_timer_summary.json")) as f:
        return json.load(f)


def sampled_mean(values: list[float], steps: list[int]) -> float:
    return sum(values[s] for s in steps) / len(steps)


def test_planted_modules_are_named_and_measured_within_5_percent(tmp_path):
    planted = Planted()
    timer = train(Net(planted), n=30, tmp=tmp_path)
    block = summary(timer)["modules"]
    rows = block["rows"]
    assert block["samples"] >= 3 and block["clock"] == "host"
    # The sleepers are the largest of their phase, by far.
    fwd = max(rows, key=lambda k: rows[k]["forward_ms"] or 0)
    bwd = max(rows, key=lambda k: rows[k]["backward_ms"] or 0)
    assert (fwd, bwd) == ("slow_fwd", "slow_bwd")
    # Each sampled value against the planted module's own measure of its sleep: within 5%.
    raw_f, raw_b = rows["slow_fwd"]["raw"]["forward_ms"], rows["slow_bwd"]["raw"]["backward_ms"]
    assert len(raw_f) == block["samples"] == len(raw_b)
    for raw, own, body in ((raw_f, planted.forward_ms, planted.forward_body_ms),
                           (raw_b, planted.backward_ms, planted.backward_body_ms)):
        assert min(raw) >= min(own)  # the sleep is inside what was measured
        # with the module's own ops (its Linear: 0.1-0.3 ms on a busy 2-core host), as the module times its whole
        # forward and backward itself; the least sample (a busy host's hiccups)
        assert min(raw) == pytest.approx(statistics.median(body), rel=0.05), (raw, body, own)
    # ... and each is only its own: the other sleeper (5 ms) is not in it, only its Linear (0.1-0.3 ms on a busy host)
    assert rows["slow_fwd"]["backward_ms"] < 0.2 * SLEEP_S * 1e3
    assert rows["slow_bwd"]["forward_ms"] < 0.2 * SLEEP_S * 1e3
    assert rows["head"]["forward_ms"] < 1.0 and rows["head"]["backward_ms"] < 1.0
    # Shares of the run's mean phases: the sleeper is most of its phase (a sampled step's sleep may outlast the mean).
    assert 0.8 < rows["slow_fwd"]["share_of_forward"] < 1.1
    assert 0.8 < rows["slow_bwd"]["share_of_backward"] < 1.1
    # The CPU has no allocator's counters: activations are not measured, never zero.
    assert rows["slow_fwd"]["activation_mb"] is None and block["activations"].startswith("not measured")
    scalars = read_scalars(timer.log_dir)
    assert "phase_module/slow_fwd/forward_ms" in scalars and "phase_module/slow_bwd/backward_ms" in scalars
    assert not any(k.endswith("activation_mb") for k in scalars)
    line = timer.core.summary_table() if timer.core is not None else None
    assert line is None or "modules" in line


def test_planted_hours_land_exactly_in_their_module_and_nowhere_else(tmp_path, host_hours):
    """On the host clock moved an hour per planted ms: 5 hours in slow_fwd's forward and slow_bwd's backward, and
    none anywhere else, whatever the machine's load."""
    planted = Planted()
    timer = train(Net(planted), n=20, tmp=tmp_path)
    rows = summary(timer)["modules"]["rows"]
    got = {k: (hours(r["forward_ms"]), hours(r["backward_ms"])) for k, r in rows.items()}
    assert got == {"slow_fwd": (5, 0), "slow_bwd": (0, 5), "head": (0, 0)}
    for key, phase in (("slow_fwd", "forward_ms"), ("slow_bwd", "backward_ms")):
        assert rows[key][phase] == pytest.approx(5 * helpers.HOUR_MS, rel=0.05)


def test_the_table_names_the_top_modules_of_forward_and_backward():
    planted = Planted()
    model = Net(planted)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, batches(16), summary=False, warmup_steps=2, window=5,
                               modules=True)
    measure = next(m for m in timer.core.measures if isinstance(m, ModuleTimes))
    with timer:
        for x in timer.loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    line = measure.line()
    assert line.startswith("modules (")
    fwd, bwd = line.split("forward: ")[1].split(";")[0], line.split("backward: ")[1].split(";")[0]
    assert fwd.startswith("slow_fwd ") and bwd.startswith("slow_bwd ")


class FakeAllocator:
    """The allocator's ``allocated`` counter, moved by the modules that say they allocate: the arithmetic of
    activation_mb (a CPU has no caching allocator to read: on CUDA the counter is torch's)."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self) -> int:
        return self.bytes


class Keeps64MB(nn.Module):
    def __init__(self, alloc: FakeAllocator) -> None:
        super().__init__()
        self.alloc = alloc
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alloc.bytes += 64 << 20  # what it keeps until backward (freed there)
        return self.lin(x)


def test_activation_arithmetic_with_a_fake_allocator_names_the_module_that_keeps_64_mb():
    alloc = FakeAllocator()

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.keeps = Keeps64MB(alloc)
            self.small = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _OnBackward.apply(self.small(self.keeps(x)), self.free)

        def free(self) -> None:  # backward frees what `keeps` kept
            alloc.bytes -= 64 << 20

    model = M()
    measure = ModuleTimes([model], True, clock=HostClock(), allocated=alloc, warmup_steps=0)
    core, bounds = _core(measure)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(12):
        _step(bounds, model, opt)
    bounds.finish()
    core.finish()
    rows = measure.rows()
    assert measure.samples >= 2
    assert rows["keeps"]["activation_mb"] == pytest.approx(64.0)
    assert rows["small"]["activation_mb"] == pytest.approx(0.0)
    assert "activations: keeps 64 MB" in measure.line()


def _core(measure: ModuleTimes) -> tuple[Any, Any]:
    """A core and its boundaries on the host clock, with ``measure`` listening (what the assembly does)."""
    from phase_timer.run.boundaries import Boundaries
    from phase_timer.run.core import TimingCore

    core = TimingCore(HostClock(), window=4, warmup_steps=0, max_pending=64, measures=[measure])
    return core, Boundaries(core)


def _step(bounds: Any, model: nn.Module, opt: Any, x: torch.Tensor | None = None, then: Any = None) -> None:
    """One training step through the boundaries; ``then()`` after its forward."""
    bounds.on_fetch()
    bounds.on_batch(None, 0.0)
    bounds.on_copied()
    loss = model(torch.randn(4, 8) if x is None else x).sum()
    if then is not None:
        then()
    bounds.on_backward_start()
    loss.backward()
    bounds.on_backward_end(False)
    bounds.on_optimizer_start()
    opt.step()
    opt.zero_grad()
    bounds.on_step_end()


def test_the_ordinary_step_carries_no_hook_and_sampled_steps_come_as_scheduled():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    core, bounds = _core(measure)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked: list[bool] = []
    first = model[0]
    for _ in range(60):
        _step(bounds, model, opt, then=lambda: hooked.append(bool(first._forward_hooks or first._forward_pre_hooks)))
    bounds.finish()
    core.finish()
    sampled = [i + 1 for i, h in enumerate(hooked) if h]  # steps begun, 1-based
    # the first after the warm-up's first timed step, then DENSE_GAP apart, then one in GAP: the schedule's steps
    # exactly (the verdict's sampled step waits for a sample due on its step)
    assert sampled == [2 + mod.DENSE_GAP * i for i in range(mod.DENSE + 1)], sampled
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks  # all taken off at the end
    assert measure.samples == len(sampled)
    cost = measure.summary()["cost"]
    assert cost["sampled_step_ms"] > 0 and cost["us_per_step"] < cost["sampled_step_ms"] * 1e3


def test_a_model_deep_copied_on_a_sampled_step_copies_and_its_copy_is_no_row():
    """An EMA copy taken mid-step (``copy.deepcopy`` after the forward, the sample's autograd nodes held): the hooks
    the copy carries are the sample's functions, shared, not copied with the sample; the copy's calls add no row."""
    import copy

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    core, bounds = _core(measure)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies: list[nn.Module] = []

    def ema() -> None:  # on a sampled step, after its forward
        if bounds._mod_on:
            copies.append(copy.deepcopy(model))
            copies[-1](torch.randn(4, 8))

    for _ in range(12):
        _step(bounds, model, opt, then=ema)
    bounds.finish()
    core.finish()
    assert len(copies) >= 2 and measure.failed is None and measure.samples == len(copies)
    assert all(row["calls"] == 1 for row in measure.rows().values())  # the copy's forward counted nowhere


def test_the_native_boundaries_hand_a_due_step_to_python():
    from phase_timer.run import boundaries

    if boundaries._Fast is None:
        pytest.skip("the C extension is not built")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    core, bounds = _core(measure)
    assert type(bounds.on_batch).__name__ == "builtin_function_or_method"  # the C path is in use
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(24):
        _step(bounds, model, opt)
    bounds.finish()
    core.finish()
    assert measure.samples == 3  # steps 2, 10, 18


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, width),
                                              h=nn.ModuleList(Block(width) for _ in range(layers)),
                                              ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # shared weights

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def test_the_default_tree_opens_what_holds_repeated_blocks_and_sums_the_blocks():
    tree = build_tree([TinyGPT()], True)
    assert list(tree.entries) == ["transformer", "transformer.wte", "transformer.h[0-3]", "transformer.h[0-3].ln",
                                  "transformer.h[0-3].attn", "transformer.h[0-3].mlp", "transformer.ln_f", "lm_head"]
    e = tree.entries
    assert e["transformer.h[0-3]"].modules == 4 and e["transformer.h[0-3].attn"].modules == 4
    assert e["transformer.h[0-3].attn"].parent == "transformer.h[0-3]"
    assert (e["transformer.h[0-3].attn"].kind, e["transformer.wte"].kind) == ("attention", "embedding")
    deep = build_tree([TinyGPT()], 1)
    assert list(deep.entries) == ["transformer", "lm_head"]
    named = build_tree([TinyGPT()], ["transformer.h.0.mlp", "lm_head"])
    assert list(named.entries) == ["transformer.h.0.mlp", "lm_head"]


def test_nested_blocks_shared_weights_and_children_never_exceed_the_parent(tmp_path, monkeypatch):
    monkeypatch.setattr(mod_tree, "GROUP_MODULES", 1000)  # one group: a parent and its children on the same steps
    model = TinyGPT()
    timer = _train_lm(model, tmp_path)
    block = summary(timer)["modules"]
    rows = block["rows"]
    for key, row in rows.items():
        assert row["forward_ms"] >= 0 and row["backward_ms"] is not None, key
        kids = [r for r in rows.values() if r["parent"] == key]
        if kids:  # inclusive times: the children's sum never exceeds the parent's (each sample's)
            for i in range(len(row["raw"]["forward_ms"])):
                assert sum(k["raw"]["forward_ms"][i] for k in kids) <= row["raw"]["forward_ms"][i] + 1e-6, key
                assert sum(k["raw"]["backward_ms"][i] for k in kids) <= row["raw"]["backward_ms"][i] + 1e-6, key
    assert rows["transformer.h[0-3]"]["calls"] == 4  # four blocks, one row
    assert rows["lm_head"]["calls"] == 1 and rows["transformer.wte"]["calls"] == 1
    assert set(block["leaves"]) >= {"transformer.h[0-3].attn", "transformer.h[0-3].mlp", "lm_head"}
    assert "transformer" not in block["leaves"]
    # every sink takes the row's name without brackets (MLflow refuses them)
    assert "phase_module/transformer.h.0-3.attn/backward_ms" in read_scalars(timer.log_dir)


def _train_lm(model: nn.Module, tmp: Any, n: int = 24, **kwargs: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(n)]
    timer = phase_timer.attach(model, opt, data, summary=False, warmup_steps=2, window=4, log_dir=str(tmp),
                               **{"modules": True, **kwargs})
    with timer:
        for idx in timer.loader:
            model(idx).backward()
            opt.step()
            opt.zero_grad()
    return timer


class Twice(nn.Module):
    def __init__(self, planted: Planted) -> None:
        super().__init__()
        self.shared = SleepyForward(planted)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(x)))


def test_a_module_called_twice_sums_its_calls(tmp_path):
    planted = Planted()
    timer = train(Twice(planted), n=14, tmp=tmp_path)
    row = summary(timer)["modules"]["rows"]["shared"]
    assert row["calls"] == 2
    # both calls summed, not one and not a third: the sleeps are 5 ms each, so the bounds hold whatever a loaded
    # 2-core host adds on the host clock around them (one sampled step here; 1.2-1.8 ms over the pair in some runs)
    assert 2 * min(planted.forward_ms) <= row["forward_ms"] < 3 * min(planted.forward_ms)
    assert row["backward_ms"] is not None


class Checkpointed(nn.Module):
    def __init__(self, planted: Planted, reentrant: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.slow = SleepyForward(planted)
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.slow, self.pre(x), use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recompute_is_reported_as_such_and_never_in_forward(tmp_path, reentrant):
    planted = Planted()
    timer = train(Checkpointed(planted, reentrant), n=14, tmp=tmp_path)
    row = summary(timer)["modules"]["rows"]["slow"]
    # once, not twice: one 5 ms sleep, whatever a loaded 2-core host adds around it on the host clock (one sampled
    # step here; 1-2 ms in some full-suite runs)
    assert min(planted.forward_ms) <= row["forward_ms"] < 2 * min(planted.forward_ms)
    # the recompute holds the sleep and checkpoint's own bookkeeping around the module's ops (a fraction of a ms)
    assert min(planted.forward_ms) <= row["recompute_ms"] < 2 * min(planted.forward_ms)
    if reentrant:  # the first forward ran without grad: no backward of its own
        assert row["backward_ms"] is None
    else:  # the graph is kept: its backward holds its recompute
        assert row["backward_ms"] >= row["recompute_ms"]


def test_an_in_place_op_on_a_module_output_still_works_on_a_sampled_step(tmp_path):
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y.add_(1.0)  # fails under full backward hooks ("a view ... modified inplace")
            torch.relu_(y)
            return self.head(y)

    timer = train(InPlace(), n=12, tmp=tmp_path)
    rows = summary(timer)["modules"]["rows"]
    assert rows["lin"]["backward_ms"] is not None and rows["head"]["backward_ms"] is not None


def test_a_compiled_model_says_so_plainly_and_gives_no_number(tmp_path):
    model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), backend="eager")
    timer = train(model, n=10, tmp=tmp_path)
    block = summary(timer)["modules"]
    assert block["rows"] == {} and block["samples"] == 0
    assert "compiled" in block["note"] and "hooks do not fire inside a compiled region" in block["note"]
    inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    inner[1].compile(backend="eager")
    tree = build_tree([inner], True)
    assert [k for k in tree.entries] == ["0"] and tree.compiled == ["1"]


@pytest.mark.parametrize("value, words", [
    (0, "a depth (an int >= 1)"),
    ("all", "True, False, a depth"),
    ([], "a list of module names"),
])
def test_a_wrong_modules_argument_fails_at_construction_naming_it(value, words):
    model = nn.Linear(8, 1)
    with pytest.raises(ValueError, match=r"attach\(modules=.*`modules` must be") as err:
        phase_timer.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), [], modules=value)
    assert words in str(err.value)


def test_an_unknown_module_name_fails_naming_the_argument_and_the_close_names():
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"`modules` must be names of the model's modules.*close: lm_head"):
        phase_timer.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), [], modules=["lm_heads"])


def test_modules_are_off_unless_asked_for(tmp_path):
    """Opt-in: a sample holds the device behind its gate and goes untimed, which a run must choose
    (``docs/modules.md``); the default run hooks nothing and writes no block."""
    model = Net(Planted())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, opt, batches(20), summary=False, warmup_steps=2, window=5,
                            log_dir=str(tmp_path)) as timer:
        assert not any(isinstance(m, ModuleTimes) for m in timer.core.measures)
        for x in timer.loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert summary(timer)["modules"] is None
    assert timer.totals.steps == 20 - 2  # every step past the warm-up timed: no sample untimed one


def test_modules_false_hooks_nothing_and_writes_no_block(tmp_path):
    timer = train(Net(Planted()), n=12, tmp=tmp_path, modules=False)
    assert summary(timer)["modules"] is None
    assert not any(k.startswith("phase_module/") for k in read_scalars(timer.log_dir))


# -- every door ------------------------------------------------------------------------------------------


def test_the_lightning_door_measures_the_lightning_module_children(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tests.helpers import loader, module_class, trainer

    model = module_class("lightning.pytorch")(forward=0.0)
    cb = phase_timer.PhaseTimer(warmup_steps=2, log_every_n_steps=4, summary=False, modules=True)
    trainer(pl.__name__, str(tmp_path), [cb], max_steps=14).fit(model, loader(n=14 * 8))
    path = os.path.join(cb.log_dir, "phase_timer_summary.json")
    with open(path) as f:
        block = json.load(f)["modules"]
    assert block["samples"] >= 2 and "net" in block["rows"]
    assert block["rows"]["net"]["forward_ms"] > 0 and block["rows"]["net"]["backward_ms"] > 0
    assert "phase_module/net/forward_ms" in read_scalars(cb.log_dir)


def test_the_transformers_door_measures_a_tiny_gpt2(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=14, per_device_train_batch_size=2,
                                          logging_steps=4, report_to=[], save_strategy="no", use_cpu=True,
                                          disable_tqdm=True)
    cb = phase_timer.PhaseTimerCallback(warmup_steps=2, summary=False, log_dir=str(tmp_path / "pt"),
                                          modules=True)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    with open(os.path.join(cb.timer.log_dir, "phase_timer_summary.json")) as f:
        block = json.load(f)["modules"]
    rows = block["rows"]
    assert block["samples"] >= 2
    assert {"transformer.wte", "transformer.h[0-1]", "transformer.h[0-1].attn", "transformer.h[0-1].mlp",
            "lm_head"} <= set(rows)
    assert rows["transformer.h[0-1].attn"]["kind"] == "attention" and rows["transformer.h[0-1]"]["calls"] == 2
    assert rows["transformer.h[0-1].attn"]["backward_ms"] > 0 and rows["lm_head"]["backward_ms"] > 0


# -- report, compare, the verdict ---------------------------------------------------------------------------


def _planted_run(tmp: Any, forward_s: float) -> str:
    planted = Planted()
    model = Net(planted)
    model.slow_fwd.forward = _sleeping(model.slow_fwd, forward_s)  # type: ignore[method-assign]
    return train(model, n=20, tmp=tmp).log_dir


def _sleeping(module: nn.Module, seconds: float) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        helpers.pause(seconds)
        return module.lin(x)

    return forward


def test_report_and_compare_name_the_module_that_got_slower(tmp_path, host_hours, capsys):
    from phase_timer.cli import main

    base = _planted_run(tmp_path / "base", 0.005)
    cand = _planted_run(tmp_path / "cand", 0.007)
    assert main(["report", cand]) == 0
    text = capsys.readouterr().out
    assert "modules: " in text and "slow_fwd" in text and "slow_bwd" in text
    assert main(["report", "--json", cand]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert hours(doc["runs"][0]["modules"]["rows"]["slow_fwd"]["forward_ms"]) == 7
    main(["compare", base, cand])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("modules: "))
    assert line.startswith("modules: slow_fwd got slower") and "+40.0%" in line
    main(["compare", "--json", base, cand])
    doc = json.loads(capsys.readouterr().out)
    assert hours(doc["modules"]["slow_fwd"]["delta_ms"]) == 2 and hours(doc["modules"]["slow_bwd"]["delta_ms"]) == 0


def test_the_verdict_names_the_module_holding_the_slow_phase_and_the_activation_holders():
    from phase_timer.diagnosis.finding import Diagnosis
    from phase_timer.diagnosis.module_rules import with_modules

    def row(kind: str, parent: str | None, fwd: float, bwd: float, act: float | None, share: float) -> dict:
        return {"kind": kind, "parent": parent, "forward_ms": fwd, "backward_ms": bwd, "activation_mb": act,
                "share_of_forward": share, "share_of_backward": share}

    block = {"rows": {"h[0-11]": row("other", None, 9, 18, 900, 0.7),
                      "h[0-11].attn": row("attention", "h[0-11]", 3, 6, 300, 0.25),
                      "h[0-11].mlp": row("mlp", "h[0-11]", 4, 8, 500, 0.3),
                      "lm_head": row("vocab_head", None, 3, 9, 1200, 0.35)},
             "leaves": ["h[0-11].attn", "h[0-11].mlp", "lm_head"]}
    gpu = Diagnosis("GPU_BOUND", "info", "the GPU is the bottleneck", ("make backward cheaper",),
                    {"largest_phase": "backward"})
    named = with_modules(gpu, block)
    assert "in backward, lm_head (vocab_head) takes 9.00 ms (35% of backward)" in named.why
    assert named.next[1].startswith("lm_head: a fused or chunked cross-entropy")
    assert named.evidence["module"] == "lm_head"
    head = Diagnosis("MEMORY_HEADROOM", "info", "room to spare", ("a larger batch",), {})
    oom = Diagnosis("OUT_OF_MEMORY", "high", "ran out", (), {}, (head,))
    said = with_modules(oom, block)
    assert "held most by lm_head 1200 MB, h[0-11].mlp 500 MB, h[0-11].attn 300 MB" in said.why
    assert said.next[-1] == "activation checkpointing on lm_head trades its recompute for its activations"
    assert "held most by lm_head" in said.secondary[0].why
    assert with_modules(gpu, None) is gpu


def test_the_verdict_reads_the_modules_block_at_the_run_end_and_the_own_cost_line_is_unchanged(monkeypatch):
    """The measure hands the verdict its block through ``Measure.verdict`` once the run's end was heard (the live
    file's verdict so far goes without it); its host cost is the block's, never the own-cost line's keywords."""
    import phase_timer.run.core as core_mod

    heard: list[Any] = []
    real = core_mod.diagnose

    def diagnose(*args: Any, **kwargs: Any) -> Any:
        heard.append(kwargs.get("modules"))
        return real(*args, **kwargs)

    monkeypatch.setattr(core_mod, "diagnose", diagnose)
    model = Net(Planted())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, batches(20), summary=False, warmup_steps=2, window=5,
                               modules=True)
    core = timer.core
    measure = next(m for m in core.measures if isinstance(m, ModuleTimes))
    with timer:
        for x in timer.loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert measure.cost() == {} and measure.host_cost() is not None
    assert heard and heard[-1] is not None and heard[-1]["samples"] == measure.samples >= 1
    assert "slow_fwd" in heard[-1]["rows"] and heard[-1]["cost"] == measure.host_cost()
    assert core.own_cost() is not None  # estimate() took every measure's cost keywords
    measure.ended = False  # as before the end: the verdict so far reads nothing of it
    assert measure.verdict() == {}


def test_the_cost_benchmark_runs_on_the_cpu():
    import argparse

    from benchmarks.modules_cost import sampled_step_cost

    args = argparse.Namespace(cpu=True, layers=2, width=32, seq=16, batch=2, vocab=256, reps=3)
    cost = sampled_step_cost(args)
    # transformer, its wte, wpe, h[0-1] with ln_1, attn, ln_2, mlp, ln_f; lm_head: 15 modules, one group
    assert cost["samples_read"] == 3 and cost["rows"] == 10 and cost["groups"] == 1
    assert cost["own_us"] > 0 and cost["marks"] > 0 and cost["run_samples"] >= mod.DENSE + 1
    assert cost["gpu_estimate_extra_us"] > cost["sampled_extra_us"]


def test_a_timer_never_closed_is_collected_with_its_model():
    """The measure holds the model's modules weakly: a loop that drops its timer and model unclosed still has its
    timer collected (and written), as without modules."""
    import gc
    import weakref

    def train() -> tuple[Any, Any]:
        model = TinyGPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        timer = phase_timer.attach(model, opt, [torch.randint(0, 64, (2, 8)) for _ in range(12)], summary=False,
                                   warmup_steps=1, modules=True)
        for idx in timer.loader:
            model(idx).backward()
            opt.step()
        return weakref.ref(timer), weakref.ref(model)

    with pytest.warns(RuntimeWarning, match="never closed"):
        timer, model = train()
        gc.collect()
    assert timer() is None and model() is None


def test_a_sampled_step_hooks_only_the_nodes_that_can_begin_or_end_a_backward_once_each(tmp_path, monkeypatch):
    """A node shared by nested calls carries one hook; a node that feeds another of the call's nodes is never its
    last, so it carries none: a 4-block TinyGPT's sample hooks far fewer nodes than its calls' edges, and the backward
    of every row is still read (its children's never more than it)."""
    monkeypatch.setattr(mod_tree, "GROUP_MODULES", 1000)  # every row on the one sample
    model = TinyGPT()
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    idx = torch.randint(0, 64, (2, 8))
    measure.begin(1, 0)
    model(idx).backward()
    sample = measure.sample
    measure.close(True)
    measure.window({})
    rows = measure.rows()
    calls = len(sample.calls)
    assert calls == 4 * 4 + 3  # each block, its ln, attn and mlp; wte, ln_f, lm_head
    assert sample.nodes <= 4 * calls, (sample.nodes, calls)
    for key, row in rows.items():
        assert row["backward_ms"] is not None and row["backward_ms"] >= 0, key
    block = rows["transformer.h[0-3]"]["backward_ms"]
    assert sum(rows[f"transformer.h[0-3].{c}"]["backward_ms"] for c in ("ln", "attn", "mlp")) <= block


class GainFirst(nn.Module):
    """A module whose oldest node feeds only a parameter, and sleeps 5 ms in backward: it runs last."""

    def __init__(self, planted: Planted) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.lin = nn.Linear(8, 8)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = _OnBackward.apply(self.gain, lambda: _sleep(self.planted.backward_ms))
        return self.lin(x) * g


def test_a_parameter_only_node_is_hooked_when_it_is_the_calls_oldest_and_left_when_newer():
    """Autograd runs a device's ready nodes newest first: a call's last node is its oldest.  A parameter's gradient
    node made first (a gain used before the input) is that node and is hooked, its 5 ms inside the backward; under
    autocast a Linear's weight and bias casts are newer than its input's cast and are left unhooked."""
    planted = Planted()
    model = nn.Sequential(nn.Linear(8, 8), GainFirst(planted))
    measure = ModuleTimes([model], ["1"], clock=HostClock(), warmup_steps=0)
    measure.begin(1, 0)
    model(torch.randn(4, 8)).sum().backward()
    measure.close(True)
    measure.window({})
    assert measure.rows()["1"]["backward_ms"] >= min(planted.backward_ms)
    measure = ModuleTimes([model], ["0", "1.lin"], clock=HostClock(), warmup_steps=0)
    measure.begin(1, 0)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    sample = measure.sample
    out.float().sum().backward()
    measure.close(True)
    measure.window({})
    # each Linear: its output's node (begins) and its input's cast (ends); the weight's and bias's casts not hooked
    assert sample.nodes == 4
    rows = measure.rows()
    assert rows["0"]["backward_ms"] is not None and rows["1.lin"]["backward_ms"] is not None


def test_a_groups_first_sample_and_one_in_act_every_read_the_allocator_and_mark_too():
    reads = []

    def alloc() -> int:
        reads.append(1)
        return 0

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), allocated=alloc, warmup_steps=0)
    assert len(measure.groups) == 1
    per_sample = []
    for i in range(2 * mod.ACT_EVERY):
        before = len(reads)
        measure.begin(i + 1, i)
        model(torch.randn(4, 8)).sum().backward()
        sample = measure.sample
        assert len(sample.marks) >= 4  # a sample that reads marks too
        measure.close(True)
        per_sample.append(len(reads) - before)
    # the group's first sample, then one in ACT_EVERY: two modules, a read at each end of each
    assert per_sample == [4 if i % mod.ACT_EVERY == 0 else 0 for i in range(2 * mod.ACT_EVERY)]
    measure.window({})
    rows = measure.rows()
    assert rows["0"]["activation_mb"] == 0.0 and rows["0"]["forward_ms"] is not None
    assert rows["0"]["samples"] == 2 * mod.ACT_EVERY


def test_a_sample_hooks_one_group_of_rows_in_turn_and_the_table_is_full_after_one_of_each(tmp_path):
    """The rows packed in the tree's order into groups of at most GROUP_MODULES modules (a row never split); each
    sample hooks one group, the least sampled first; until every group is read the table says how many were and the
    verdict names no module (the largest of a part is not the largest)."""
    from phase_timer.diagnosis.finding import Diagnosis
    from phase_timer.diagnosis.module_rules import with_modules

    model = TinyGPT()  # 20 modules: [transformer, wte, h[0-3], its ln and attn] (14) and [its mlp, ln_f, lm_head] (6)
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    groups = [sorted(g) for g in measure.groups]
    assert groups == [sorted(["transformer", "transformer.wte", "transformer.h[0-3]", "transformer.h[0-3].ln",
                              "transformer.h[0-3].attn"]),
                      sorted(["transformer.h[0-3].mlp", "transformer.ln_f", "lm_head"])]
    assert all(sum(measure.tree.entries[k].modules for k in g) <= mod.GROUP_MODULES for g in groups)
    idx = torch.randint(0, 64, (2, 8))
    hooked = []
    for i in range(4):
        measure.begin(i + 1, i)
        hooked.append({k for m, k in measure.tree.modules() if m._forward_hooks})
        model(idx).backward()
        measure.close(True)
        measure.window({})
        if i == 0:
            assert not measure.complete and measure.groups_read() == 1
            assert ", 1 of 2 groups of rows read," in measure.line()
            block = measure.summary()
            assert block["complete"] is False and block["groups"] == 2 and block["groups_read"] == 1
            d = Diagnosis("GPU_BOUND", "info", "the device is busy", ("a",), {"largest_phase": "backward"})
            assert with_modules(d, block) == d  # a part of the table names nothing
            assert "lm_head" not in measure.rows()
    assert [sorted(h) for h in hooked] == groups * 2
    assert measure.complete and "groups of rows read" not in measure.line()
    rows = measure.rows()
    assert all(rows[k]["samples"] == 2 for k in rows)  # transformer (a ModuleDict) is never called: no row
    assert set(rows) == {k for g in groups for k in g} - {"transformer"}


def test_a_dropped_sample_leaves_its_group_to_the_next():
    model = TinyGPT()
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    idx = torch.randint(0, 64, (2, 8))
    parts = []
    for i, keep in enumerate((True, False, True, True)):
        measure.begin(i + 1, i)
        parts.append(measure.sample.part)
        model(idx).backward()
        measure.close(keep)
    assert parts == [0, 1, 1, 0] and measure.dropped == 1


class Partly(nn.Module):
    """A model whose spare blocks never run in training (20 of them: two groups of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 1)
        self.spare = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_group_whose_modules_never_run_is_taken_in_its_turn_and_counts_as_read():
    measure = ModuleTimes([model := Partly()], True, clock=HostClock(), warmup_steps=0)
    assert [sorted(g) for g in measure.groups] == [["body"], ["spare[0-19]"], ["spare[0-19].0"]]
    parts = []
    for i in range(4):
        measure.begin(i + 1, i)
        parts.append(measure.sample.part)
        model(torch.randn(4, 8)).sum().backward()
        measure.close(True)
    measure.window({})
    assert parts == [0, 1, 2, 0] and measure.complete and measure.samples == 2 and measure.dropped == 2
    assert set(measure.rows()) == {"body"}


def test_a_gpt2_sized_tree_is_five_groups_and_the_dense_samples_read_each_once():
    """The 12-layer GPT-2 of benchmarks/modules_cost.py (the budget's model): 65 modules in 5 groups of at most 16;
    on the device's clock the dense samples are at least as many as the groups (DENSE and the one they schedule)."""
    from benchmarks.modules_cost import GPT

    model = GPT(layers=12, width=64, heads=2, vocab=128, seq=16)
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0, dense=mod.DENSE)
    sizes = [sum(measure.tree.entries[k].modules for k in g) for g in measure.groups]
    # [transformer, wte, wpe, h[0-11]], [h.ln_1], [h.attn], [h.ln_2], [h.mlp, ln_f, lm_head]
    assert len(measure.tree.targets) == 65 and sizes == [15, 12, 12, 12, 14]
    assert measure._dense_n + 1 == len(measure.groups) == mod.DENSE + 1
    assert ModuleTimes([model], True, clock=HostClock(), warmup_steps=0, dense=0)._dense_n == 0  # the host clock's
    idx = torch.randint(0, 128, (2, 16))
    for i in range(5):
        measure.begin(i + 1, i)
        model(idx).backward()
        measure.close(True)
    measure.window({})
    assert measure.complete and measure.samples == 5
    assert {k for k, r in measure.rows().items() if r["forward_ms"] is not None} == set(measure.tree.entries) - {"transformer"}


def test_the_gates_check_reads_only_spans_whose_marks_were_queued_before_the_device_reached_the_one_before():
    """The gate's check, on planted times: marks (device ns) and the host's ns at each; a span with a mark queued
    after the device reached the mark before it (the device waited for the host there) is not read."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    sample = mod.Sample(measure, 0)
    ms = 1_000_000
    # the gate: queued at host 0, its sleep from device 0 to 5 ms
    sample.gate = (0, 0, 5 * ms, 1)
    # "a": marks 0 -> 1, both queued before the gate's end (host 1 and 2 ms): covered, 1 ms on the device
    # "b": marks 2 -> 3, mark 3 queued at host 9 ms, after the device reached mark 2 (at 7 ms): not read
    sample.marks = [5 * ms, 6 * ms, 7 * ms, 7 * ms + ms // 10]
    sample.host = [1 * ms, 2 * ms, 3 * ms, 9 * ms]
    sample.forward = [("0", 0, 1), ("1", 2, 3)]
    vals = sample.values()
    assert vals["0"]["forward_ms"] == pytest.approx(1.0)
    assert "1" not in vals and sample.uncovered == 1
    # the same, with mark 3 queued at host 6.9 ms (before the device reached mark 2): read
    sample.uncovered = 0
    sample.host[3] = 6_900_000
    vals = sample.values()
    assert vals["1"]["forward_ms"] == pytest.approx(0.1) and sample.uncovered == 0


def _planted_gate_sample(host_last_ms: float) -> tuple[Any, Any]:
    """A sample on planted times: the gate queued at host 0 ms, its sleep from device 0 to 5 ms; row "0" (marks 0 ->
    1) and row "1" (two calls: marks 0 -> 1 and 2 -> 3); marks at device 5, 6, 7, 7.1 ms, queued by the host at 1, 2,
    3 and ``host_last_ms`` ms.  Its measure carries a gate (the sizing alone: no CUDA)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    measure.gate = mod._Gate(HostClock(), cuda=False)
    sample = mod.Sample(measure, 0, part=0)
    ms = 1_000_000
    sample.gate = (0, 0, 5 * ms, 1)
    sample.marks = [5 * ms, 6 * ms, 7 * ms, 7 * ms + ms // 10]
    sample.host = [1 * ms, 2 * ms, 3 * ms, int(host_last_ms * ms)]
    sample.forward = [("0", 0, 1), ("1", 0, 1), ("1", 2, 3)]
    return measure, sample


def test_a_row_with_an_uncovered_span_is_not_read_from_that_sample_not_even_its_other_calls():
    measure, sample = _planted_gate_sample(9.0)  # the last mark queued after the device reached the one before
    vals = sample.values()
    assert vals["0"]["forward_ms"] == pytest.approx(1.0) and vals["0"]["calls"] == 1
    assert "1" not in vals and sample.uncovered == 1  # its first call's 1 ms alone would read short
    measure, sample = _planted_gate_sample(6.9)
    vals = sample.values()
    assert vals["1"]["forward_ms"] == pytest.approx(1.1) and vals["1"]["calls"] == 2 and sample.uncovered == 0


def test_a_group_is_read_only_once_a_sample_of_it_had_every_span_covered():
    measure, sample = _planted_gate_sample(9.0)
    measure._pending.append(sample)
    measure._read()
    assert measure.samples == 1 and measure.uncovered == 1 and not measure.complete
    assert measure.summary()["cost"]["uncovered"] == 1.0  # the gate's figures are the summary's
    _, sample = _planted_gate_sample(6.9)
    sample.m = measure
    measure._pending.append(sample)
    measure._read()
    assert measure.complete and measure.rows()["1"]["samples"] == 1


def test_the_gate_is_sized_per_group_from_the_sleep_the_sample_needed_and_bounded_by_the_step_period():
    """The next gate of a group: the sleep that would have left every mark queued in time, with the margin; a
    device far ahead of the host (a GPU-bound run) shrinks it to the least; a mark queued late grows it; never past
    the run's step period with the margin; a group not yet read takes the last length sized, and the run's first the
    host's time of the step before (the pilot) with the margin."""
    G = mod._Gate
    measure, sample = _planted_gate_sample(6.9)  # every mark in time; mark 3 needed 6.9 - 2 ms of busy = 4.9 ms
    sample.values()
    gate = measure.gate
    want = (5.0 - 0.1) * mod.GATE_MARGIN_START + mod.GATE_PAD_MS  # the run's first samples: the starting margin
    assert gate.by_group == {0: pytest.approx(want)} and gate.length(0) == pytest.approx(want)
    assert gate.length(3) == pytest.approx(want)  # a group not read yet: the last sized
    measure, sample = _planted_gate_sample(9.0)  # the last mark 2 ms late: uncovered, so longer, the margin doubled
    sample.values()
    assert measure.gate.margin == min(mod.GATE_MARGIN_MAX, 2 * mod.GATE_MARGIN_START)
    assert measure.gate.length(0) == pytest.approx((5.0 + 2.0) * measure.gate.margin + mod.GATE_PAD_MS)
    gate = G(HostClock(), cuda=False)
    assert gate.length(0) == mod.GATE_FIRST_MS  # nothing sized, no pilot
    assert gate.length(0, host_ms=20.0) == pytest.approx(20.0 * mod.GATE_MARGIN_START + mod.GATE_PAD_MS)  # the pilot's
    gate.size(1, 5.0, -35.0, 2.0, False)  # the device was 40 ms behind the host at the worst mark: no gate needed
    assert gate.length(1) == mod.GATE_MIN_MS and gate.length(0) == mod.GATE_MIN_MS
    assert gate.length(2, host_ms=20.0) == mod.GATE_MIN_MS and gate.capped == 0  # sized once: the pilot is not used
    gate.size(2, 60.0, 90.0, 90.0, True)  # 30 ms late after a 60 ms sleep: over the cap
    assert gate.length(2) == mod.GATE_MAX_MS and gate.capped == 1
    gate.bound(4.0)  # a 4 ms step: no gate past 4 x the margin (doubled by the late sample) + the pad
    assert gate.margin == min(mod.GATE_MARGIN_MAX, 2 * mod.GATE_MARGIN_START)
    assert gate.length(2) == pytest.approx(4.0 * gate.margin + mod.GATE_PAD_MS) and gate.length(1) == mod.GATE_MIN_MS


def test_a_group_is_futile_only_where_the_hosts_time_grew_with_the_sleep():
    """A step that waits for the device inside it (a sync, or a launch queue filled while the device sleeps) waits
    out any sleep: the host's time to its last mark grows with the sleep, and the group is futile (the least gate
    from then on).  A longer sleep that still left a mark late while the host's own time stayed put is a gate sized
    short, not a futile one: the next is sized longer (the rule that read the slacks alone called the 6-layer GPT's
    first group futile on an H200 and never read it)."""
    G = mod._Gate
    gate = G(HostClock(), cuda=False)
    gate.size(0, 10.0, 13.0, 12.0, True)  # late: the next sleep longer (the margin doubled, to the most)
    assert gate.margin == min(mod.GATE_MARGIN_MAX, 2 * mod.GATE_MARGIN_START)
    assert gate.length(0) == pytest.approx(13.0 * gate.margin + mod.GATE_PAD_MS) and not gate.futile
    gate.size(0, 16.5, 17.0, 12.5, True)  # late again, the host's time the same: still sized, not futile
    assert not gate.futile and gate.length(0) == pytest.approx(17.0 * mod.GATE_MARGIN_MAX + mod.GATE_PAD_MS)
    gate.size(0, 21.5, 22.0, 18.0, True)  # 5 ms more sleep, the host 5.5 ms later to its last mark: it waited
    assert gate.futile == {0} and gate.length(0) == mod.GATE_MIN_MS
    assert gate.margin == mod.GATE_MARGIN_MAX  # a futile group's late marks move no margin
    gate.size(1, 10.0, 13.0, 12.0, True)
    gate.size(1, 16.5, 12.0, 16.0, False)  # a longer sleep that covered it: no futile group, however the host moved
    assert gate.futile == {0} and gate.length(1) == pytest.approx(12.0 * mod.GATE_MARGIN_MAX + mod.GATE_PAD_MS)


def test_a_late_mark_widens_every_groups_margin_and_covered_samples_ease_it_back():
    """The host's time to a sample's last mark moves between samples on a loaded host (up to 2.5x on a 4 x H200
    host): the run starts at GATE_MARGIN_START, so a host that moves before any mark was late is covered; GATE_EASE
    samples in a row with every mark in time halve it, down to GATE_MARGIN, so a quiet host keeps the least gate; a
    mark queued late doubles the run's margin for every group's next gate (up to GATE_MARGIN_MAX), so a host that
    moved once is covered when it moves again.  The cap (the step period with the margin) moves with it."""
    gate = mod._Gate(HostClock(), cuda=False)
    gate.bound(20.0)
    assert gate.margin == mod.GATE_MARGIN_START > mod.GATE_MARGIN
    assert gate.cap == pytest.approx(20.0 * mod.GATE_MARGIN_START + mod.GATE_PAD_MS)
    for i in range(mod.GATE_EASE):  # covered from the start: the starting margin, then (the GATE_EASE-th) the least
        assert gate.margin == mod.GATE_MARGIN_START, i
        gate.size(0, 10.0, 8.0, 9.0, False)
    assert gate.margin == mod.GATE_MARGIN and gate.length(0) == pytest.approx(8.0 * mod.GATE_MARGIN + mod.GATE_PAD_MS)
    gate.size(1, 10.0, 20.0, 20.0, True)  # group 1's host moved to 20 ms past a 10 ms gate: late
    assert gate.margin == 2 * mod.GATE_MARGIN and not gate.futile
    assert gate.length(1) == pytest.approx(20.0 * gate.margin + mod.GATE_PAD_MS)
    # every group's next gate, the ones sized before the miss too, and a group not yet read
    assert gate.length(0) == pytest.approx(8.0 * gate.margin + mod.GATE_PAD_MS)
    assert gate.length(5) == pytest.approx(20.0 * gate.margin + mod.GATE_PAD_MS)
    assert gate.by_group == {0: gate.length(0), 1: gate.length(1)}
    assert gate.cap == pytest.approx(20.0 * gate.margin + mod.GATE_PAD_MS)
    gate.size(2, 10.0, 30.0, 30.0, True)
    assert gate.margin == mod.GATE_MARGIN_MAX  # never past the most
    for i in range(mod.GATE_EASE - 1):
        gate.size(0, 20.0, 8.0, 9.0, False)
        assert gate.margin == mod.GATE_MARGIN_MAX, i
    gate.size(0, 20.0, 8.0, 9.0, False)  # the GATE_EASE-th covered in a row: halved, for every group
    assert gate.margin == pytest.approx(mod.GATE_MARGIN_MAX / 2)
    assert gate.length(0) == pytest.approx(8.0 * gate.margin + mod.GATE_PAD_MS)
    assert gate.length(2) == gate.cap == pytest.approx(20.0 * gate.margin + mod.GATE_PAD_MS)  # 30 ms needed: capped
    for _ in range(mod.GATE_EASE - 1):
        gate.size(0, 20.0, 8.0, 9.0, False)
    gate.size(1, 20.0, 25.0, 21.0, True)  # a late one (the host not held by the sleep) resets the count, doubles
    assert gate.margin == mod.GATE_MARGIN_MAX and gate.covered == 0 and not gate.futile
    for _ in range(3 * mod.GATE_EASE):
        gate.size(0, 20.0, 8.0, 9.0, False)
    assert gate.margin == mod.GATE_MARGIN  # never below the least


def test_a_late_samples_need_counts_only_the_spans_the_device_ran_back_to_back():
    """After a mark queued late the device waited for the host, and the spans after it hold that wait: counted as
    the device's own time they would size the next gate short.  Planted: the gate queued at host 0 ms, its sleep
    from device 0 to 5 ms; marks at device 5, 8.1, 9.1 and 9.6 ms, queued by the host at 1, 8, 9 and 9.5 ms (the
    device reached mark 0 at 5 ms and waited for mark 1's launch at 8).  Only the span into mark 0 is known to be the
    device's own (0 ms), so the need is the host's 9.5 ms to the last mark; the worst slack (mark 1's, -3 ms) would
    have said 8 ms, and with 8 ms the device would still have reached mark 2 (8 ms plus its own time to it) before
    the host queued mark 3."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    measure.gate = mod._Gate(HostClock(), cuda=False)
    sample = mod.Sample(measure, 0, part=0)
    ms = 1_000_000
    sample.gate = (0, 0, 5 * ms, 1)
    sample.marks = [5 * ms, int(8.1 * ms), int(9.1 * ms), int(9.6 * ms)]
    sample.host = [1 * ms, 8 * ms, 9 * ms, int(9.5 * ms)]
    sample.forward = [("0", 0, 1), ("1", 2, 3)]
    vals = sample.values()
    assert vals == {} and sample.uncovered == 2
    assert measure.gate.margin == min(mod.GATE_MARGIN_MAX, 2 * mod.GATE_MARGIN_START)  # late: doubled
    assert measure.gate.length(0) == pytest.approx(9.5 * measure.gate.margin + mod.GATE_PAD_MS)
    assert measure.gate.last[0] == (pytest.approx(5.0), pytest.approx(9.5), True)


class _HostGate(mod._Gate):
    """The gate's sizing and checks on the host clock (no CUDA here): ``hold`` takes two host marks for the sleep,
    ``slept_s`` apart in the past (a long one covers every mark; a zero one leaves each mark after the first late,
    since on the host a mark is queued after the one before is reached), and keeps each length it was asked for."""

    def __init__(self) -> None:
        super().__init__(HostClock(), cuda=False)
        self.slept_s = 0.0
        self.asked: list[float] = []
        self.hosts: list[float | None] = []
        self.unsized: list[bool] = []  # nothing sized yet when asked (the pilot's or the first length)

    def hold(self, group: int, host_ms: float | None = None) -> tuple[int, Any, Any, int]:
        self.asked.append(self.length(group, host_ms))
        self.hosts.append(host_ms)
        self.unsized.append(self.ms is None)
        now = time.perf_counter_ns()
        return now, now - int(self.slept_s * 1e9), now, 1


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_a_group_not_read_whole_is_taken_again_first_and_the_steps_sampled_are_the_same_whatever_was_read(
        monkeypatch):
    """A group whose sample left a span uncovered (a gate too short for it) is taken before the groups already read
    (the H200's 40-step run took 5 samples of 3 groups in turn, the third group's one uncovered, and never completed);
    the steps sampled never depend on what was read, so that every rank of a distributed run samples the same steps
    (a rank's gate holds its collectives, and its peers would wait for it on a step they time)."""
    monkeypatch.setattr(mod_tree, "GROUP_MODULES", 1)  # a, b, c: three groups

    def run(covered: tuple[bool, ...]) -> tuple[list[int], list[int], ModuleTimes]:
        model = _Three()
        measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0, dense=1)
        gate = measure.gate = _HostGate()
        x = torch.randn(4, 8)
        parts, dues = [], []
        begun = 1
        for ok in covered:
            gate.slept_s = 1.0 if ok else 0.0
            measure.begin(begun, begun - 1)
            parts.append(measure.sample.part)
            model(x).sum().backward()
            measure.close(True)
            begun = measure.next_due
            dues.append(begun)
            measure.window({})
        return parts, dues, measure

    parts, dues, measure = run((True, False, True, True, True, True))
    assert parts[:4] == [0, 1, 2, 1] and measure.uncovered > 0 and measure.complete
    clean_parts, clean_dues, clean = run((True,) * 6)
    assert clean_parts == [0, 1, 2, 0, 1, 2] and clean.uncovered == 0 and clean.complete
    assert dues == clean_dues  # the same steps, whatever each sample read


def test_a_modules_sample_keeps_its_step_when_the_verdicts_sampled_step_falls_on_it():
    """The verdict's sampled step (the host's time, at random on each rank) waits one step for a modules' sample due
    on its step, rather than moving the sample: the sample's step is the schedule's on every rank."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    measure = ModuleTimes([model], True, clock=HostClock(), warmup_steps=0)
    core, bounds = _core(measure)
    due = measure.next_due
    bounds._sample_in = due - 1  # the verdict's sampled step would begin on the modules' first due step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[bool, str]] = []
    first = model[0]
    for _ in range(due + 2):
        _step(bounds, model, opt,
              then=lambda: seen.append((bool(first._forward_hooks), type(bounds).__name__)))
    bounds.finish()
    core.finish()
    hooked = [i + 1 for i, (h, _) in enumerate(seen) if h]
    verdict = [i + 1 for i, (_, name) in enumerate(seen) if name != "Boundaries"]
    assert hooked[0] == due and verdict[0] == due + 1, (hooked, verdict)


class _GatedTimes(ModuleTimes):
    """The measure as the device's clock runs it (a sampled step untimed, a gate sized), on the host clock."""

    untimed = True


@pytest.mark.parametrize("native", [True, False])
def test_a_gated_sample_and_the_step_after_it_are_untimed_and_the_first_gate_is_the_pilots(native, monkeypatch):
    """Where a gate is sized, the step before a sample is its pilot: the host's time of that step sizes the run's
    first gate (with the margin), never a fixed guess.  The gated sample is untimed, and so is the step after it
    (the gate can leave the device behind into it: its phases would be the device's alone): every other step is
    timed, through the C boundaries and the Python ones alike."""
    if not native:
        monkeypatch.setenv("PHASE_TIMER_NATIVE", "0")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    measure = _GatedTimes([model], True, clock=HostClock(), warmup_steps=0, dense=mod.DENSE)
    gate = measure.gate = _HostGate()
    gate.slept_s = 1.0
    core, bounds = _core(measure)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked: list[bool] = []
    first = model[0]
    steps = 30
    for _ in range(steps):
        _step(bounds, model, opt, then=lambda: hooked.append(bool(first._forward_hooks)))
    bounds.finish()
    core.finish()
    sampled = [i + 1 for i, h in enumerate(hooked) if h]  # steps begun, 1-based
    assert len(sampled) >= 3 and measure.samples == len(sampled) and measure.uncovered == 0
    assert gate.hosts[0] is not None and gate.hosts[0] > 0  # the pilot's: the step before the first sample
    assert gate.asked[0] == pytest.approx(gate.hosts[0] * mod.GATE_MARGIN_START + mod.GATE_PAD_MS)
    # then each gate is one sized from a read sample, never the pilot's again; every sample had its pilot (a sample
    # the verdict's sampled step defers has that step for its pilot)
    assert gate.unsized == [True] + [False] * (len(sampled) - 1) and all(h is not None for h in gate.hosts)
    after = [s + 1 for s in sampled if s + 1 <= steps]
    assert core.totals.steps == steps - len(sampled) - len(after)


def test_a_calls_backward_ends_at_its_oldest_node_which_autograd_runs_after_all_its_others(monkeypatch):
    """The end hook goes on a call's oldest node alone: autograd runs a device's ready nodes newest first, and each
    node of the call waits only on newer ones, so the oldest runs after every other node of the call.  On the
    GPT-2-shaped model under bf16 autocast (blocks, attention, MLPs, casts, tied weights), for every hooked call:
    the search's node is the oldest of all the call's nodes its outputs reach (a full walk, here), and a hook on
    every one of those nodes hears the oldest finish last."""
    from benchmarks.modules_cost import GPT

    torch.manual_seed(0)
    model = GPT(layers=3, width=32, heads=2, vocab=96, seq=16)
    measure = ModuleTimes([model], 3, clock=HostClock(), warmup_steps=0)  # blocks and their children: nested calls
    measure.groups = [frozenset(measure.tree.entries)]  # every row on the one sample
    measure._visits = measure._clean = measure._acts = [0]
    idx = torch.randint(0, 96, (2, 16))
    outs: dict[int, list[Any]] = {}  # each call's output nodes, as the sample saw them (it keeps none)
    hooks = mod.Sample._backward_hooks

    def seeing(sample: Any, nest: list[Any]) -> None:
        outs.update({id(c): list(c.outs) for c in nest})
        hooks(sample, nest)

    monkeypatch.setattr(mod.Sample, "_backward_hooks", seeing)
    measure.begin(1, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx)
    sample = measure.sample
    assert all(not c.outs for c in sample.calls)  # the sample holds no node of the graph
    order: list[Any] = []
    handles = []
    checked = 0
    found: dict[int, tuple[set, Any]] = {}
    for call in sample.calls:
        nodes, todo = set(), list(outs[id(call)])
        while todo:  # every node of the call its outputs reach
            node = todo.pop()
            if node in nodes:
                continue
            nodes.add(node)
            todo += [n for n, _ in node.next_functions if n is not None and call.lo <= n._sequence_nr() < call.hi]
        oldest = min(nodes, key=lambda n: n._sequence_nr())
        assert mod._oldest(outs[id(call)], call.lo, call.hi) is oldest, call.key
        for node in nodes:
            handles.append(node.register_hook(lambda gi, go, node=node: order.append(node)))
        found[id(call)] = (nodes, oldest)
        checked += len(nodes) > 1
    loss.backward()
    for call in sample.calls:
        nodes, oldest = found[id(call)]
        ran = [n for n in order if n in nodes]
        assert ran[-1] is oldest, call.key
    for h in handles:
        h.remove()
    measure.close(True)
    measure.window({})
    assert checked >= 3 * 3 and all(r["backward_ms"] is not None for r in measure.rows().values() if r["calls"])


class _Tied(nn.Module):
    """An embedding and a head that share its weight (nanoGPT's tie), with a planted backward between them."""

    def __init__(self, vocab: int, width: int, then: Any = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.then = then

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.wte(idx))
        if self.then is not None:
            x = _OnBackward.apply(x, self.then)
        return self.head(torch.tanh(x)).logsumexp(-1).mean()


class _DeviceLike(HostClock):
    """The host's marks under a device's name: the sample hooks as on a device (no gate: not CUDA)."""

    kind = "device"


def _moved_ends(monkeypatch: pytest.MonkeyPatch, model: nn.Module, rows: Any, clock: Any) -> tuple[Any, set[str]]:
    """One sample of ``rows``: the measure, and the rows whose backward end moved past their oldest node's."""
    at: dict[int, int] = {}
    ends = mod.Sample._ends

    def spy(self: Any, calls: list[Any], state: Any) -> Any:
        hook = ends(self, calls, state)

        def seen(gi: Any, go: Any) -> None:
            hook(gi, go)
            at.update({id(c): c.end for c in calls})

        return seen

    monkeypatch.setattr(mod.Sample, "_ends", spy)
    measure = ModuleTimes([model], True, clock=clock, warmup_steps=0)
    measure.groups = [frozenset(rows)]
    measure._visits = measure._clean = measure._acts = [0]
    measure.begin(1, 0)
    sample = measure.sample
    model(torch.randint(0, model.wte.num_embeddings, (2, 8))).backward()
    moved = {c.key for c in sample.calls if id(c) in at and c.end != at[id(c)]}
    measure.close(True)
    measure.window({})
    return measure, moved


def test_a_calls_backward_end_moves_past_the_gradient_sums_to_the_parameters_node_run_next(monkeypatch):
    """Autograd's engine sums a node's gradients into the buffers of the nodes they feed after the node's
    post-hook, in the node's own evaluation (a tied weight's two gradients, in the embedding's): the profiler counts
    them there (a GPT-2's `wte` backward read 0.107 ms, 28%, short of it on an H200 without them).  On a device's
    clock the end moves to the first parameter's node the oldest node made ready, which the engine runs next: the
    embedding's.  The middle Linear's oldest node (its input's reshape) feeds no parameter's node: its end stays.  The
    tied head's oldest node feeds the shared weight's node, which waits for the embedding's gradient and runs after
    other rows' marks: its end stays."""
    torch.manual_seed(0)
    measure, moved = _moved_ends(monkeypatch, _Tied(vocab=256, width=16), {"wte", "mid", "head"}, _DeviceLike())
    # each row's output node and its oldest; the weight's node, fed by wte's and head's oldest; head's input's node
    assert moved == {"wte"} and measure.nodes == 3 + 3 + 2 + 1
    assert all(measure.rows()[k]["backward_ms"] is not None for k in ("wte", "mid", "head"))
    # on the host's clock the sums run inline, in the gap: no parameter's node is hooked, no end moves
    measure, moved = _moved_ends(monkeypatch, _Tied(vocab=256, width=16), {"wte", "mid", "head"}, HostClock())
    assert moved == set() and measure.nodes == 3 + 3


def _no_close(self: Any, state: Any) -> Any:
    return lambda grad_outputs: None


@pytest.mark.parametrize("guards", ["all", "inputs", "after", "none"])
def test_a_calls_end_never_moves_to_a_shared_weights_node_that_ran_behind_other_nodes(monkeypatch, guards):
    """The tied head's oldest node (its weight's transpose) feeds the shared weight's node, which waits for the
    embedding's gradient: hooked alone, no mark is taken before that node runs, after the whole backward below the
    head (here a planted 30 ms).  The head's input's node runs first (the engine's next ready node) and keeps the end
    at the oldest node; AFTER_NS keeps it too (``inputs``: AFTER_NS lifted, that guard alone; ``after``: the inputs'
    guard lifted, AFTER_NS alone); without either (``none``) the head's backward would hold the 30 ms."""
    if guards in ("inputs", "none"):
        monkeypatch.setattr("phase_timer.measures.modules.sample.AFTER_NS", 10**12)
    if guards in ("after", "none"):
        monkeypatch.setattr(mod.Sample, "_close", _no_close)
    torch.manual_seed(0)
    model = _Tied(vocab=256, width=16, then=lambda: time.sleep(0.03))
    measure, moved = _moved_ends(monkeypatch, model, {"head"}, _DeviceLike())
    assert measure.nodes == 4  # the head's output node, its oldest, the tied weight's node it feeds, its input's
    got = measure.rows()["head"]["backward_ms"]
    if guards != "none":
        assert moved == set() and got < 15.0, got
    else:
        assert moved == {"head"} and got >= 30.0, got


def test_a_calls_end_never_moves_past_a_mark_taken_since(monkeypatch):
    """Every row hooked, the other two guards lifted: the tied head's end stays, for the rows' marks taken before the
    shared weight's node runs (the embedding's end moves, as the engine runs that node right after it)."""
    monkeypatch.setattr("phase_timer.measures.modules.sample.AFTER_NS", 10**12)
    monkeypatch.setattr(mod.Sample, "_close", _no_close)
    torch.manual_seed(0)
    _, moved = _moved_ends(monkeypatch, _Tied(vocab=256, width=16), {"wte", "mid", "head"}, _DeviceLike())
    assert moved == {"wte"}

def _rank_totals(phase_ms: dict[int, dict[str, float]], rows: dict[int, dict[str, dict[str, float]]]) -> Any:
    """Rank zero's totals of every rank: each phase's mean over 10 steps, and each rank's leaf rows as its reports
    sum them (two samples of each, the same values)."""
    from phase_timer.distributed.ranks import RankTotals
    from phase_timer.measures.modules.ranks import report_key

    totals = RankTotals(world_size=len(phase_ms))
    for rank, phases in phase_ms.items():
        counts: dict[str, float] = {}
        for row, vals in rows[rank].items():
            for name, v in vals.items():
                counts[report_key(row, name)] = 2 * v
                counts[report_key(row, name) + "#"] = 2.0
        totals.put(rank, {"s": 10, "p": {p: [10 * v, 10] for p, v in phases.items()}, "c": counts})
    return totals


def test_rank_zero_names_the_module_where_the_slow_rank_loses_its_time():
    """The slow rank in a phase is the one furthest above the other ranks' median (not a median that counts it:
    with two ranks that would halve the gap); its module is the leaf row furthest above the other ranks' median of
    that row, named only where it holds a quarter of the gap or more.  A gap outside the modules (a rank that
    waited in a collective) names none."""
    from phase_timer.measures.modules import ranks as mod_ranks

    rows = {r: {"h": {"forward_ms": 4.0, "backward_ms": 8.0}, "head": {"forward_ms": 1.0, "backward_ms": 2.0}}
            for r in range(4)}
    rows[2]["h"]["backward_ms"] = 17.5  # rank 2's blocks lose 9.5 ms in backward
    phases = {r: {"forward": 6.0, "backward": 12.0} for r in range(4)}
    phases[2]["backward"] = 22.0
    phases[3]["forward"] = 6.2  # within the ranks' noise: nothing named in forward
    totals = _rank_totals(phases, rows)
    (found,) = mod_ranks.slow_modules(totals, {"h", "head"})
    assert (found["rank"], found["phase"], found["module"]) == (2, "backward", "h")
    assert found["rank_ms"] == 22.0 and found["others_ms"] == 12.0
    assert found["module_ms"] == 17.5 and found["module_others_ms"] == 8.0 and found["module_gap_ms"] == 9.5
    assert mod_ranks.text([found]) == ("every rank: rank 2's backward 10.00 ms a step above the other ranks' median "
                                       "(12.00), 9.50 of it in h (17.50 ms against 8.00)")
    assert mod_ranks.block(totals, {"h", "head"})["per_rank"]["2"]["h"] == {"forward_ms": 4.0, "backward_ms": 17.5}
    # two ranks: the gap against the other rank, whole
    two = _rank_totals({0: phases[0], 1: phases[2]}, {0: rows[0], 1: rows[2]})
    (found,) = mod_ranks.slow_modules(two)
    assert (found["rank"], found["others_ms"], found["module_gap_ms"]) == (1, 12.0, 9.5)
    # rank 1 waited 10 ms for the others inside backward, outside every module: no module named
    waited = {r: {"forward": 6.0, "backward": 22.0 if r == 1 else 12.0} for r in range(4)}
    assert mod_ranks.slow_modules(_rank_totals(waited, {r: rows[0] for r in range(4)})) == []
    # one process, or no rows reported: nothing
    assert mod_ranks.slow_modules(_rank_totals({0: phases[0]}, {0: rows[0]})) == []
    assert mod_ranks.text([]) is None


def test_a_ranks_report_carries_its_leaf_rows_read_since_the_last_one():
    """Each window report carries the leaf rows read since the last (their sums and counts): rank zero's exchange
    sums them per rank; a parent row is not sent (its children's sum holds it), and nothing twice."""
    from phase_timer.measures.modules.ranks import PREFIX, report_key

    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
    measure = ModuleTimes([model], 2, clock=HostClock(), warmup_steps=0)
    measure.groups = [frozenset(measure.tree.entries)]
    measure._visits = measure._clean = measure._acts = [0]
    assert measure.report() == {}
    measure.begin(1, 0)
    model(torch.randn(2, 4)).sum().backward()
    measure.close(True)
    measure.window({})
    sent = measure.report()
    leaves = set(measure.leaves())
    rows = measure.rows()
    assert leaves and leaves < set(rows)  # a parent row read, not sent
    assert {k[len(PREFIX):].rsplit("|", 1)[0] for k in sent} == leaves
    for key in leaves:
        for name in ("forward_ms", "backward_ms"):
            assert sent[report_key(key, name)] == pytest.approx(rows[key][name])
            assert sent[report_key(key, name) + "#"] == 1.0
    assert measure.report() == {}  # sent once
