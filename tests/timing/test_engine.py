"""The C engine (``_native.Steps``) against the Python one (``PyEngine``): same calls, same results."""

from __future__ import annotations

import random

import pytest

from phase_timer.timing.clock import HostClock
from phase_timer.run.core import TimingCore
from phase_timer.timing.engine import PyEngine, Steps, make_engine, native_steps
from tests.fakes import FakeClock

needs_steps = pytest.mark.skipif(Steps is None, reason="the C extension is not built")


class CountingHostClock(HostClock):
    """A host clock on a shared fake counter, so both engines see the same marks."""

    def __init__(self, ticks) -> None:
        self._ticks = ticks

    def mark(self) -> int:
        return self._ticks()


def fake_ns(seed: int):
    rng = random.Random(seed)
    state = {"t": 1_000_000}

    def now() -> int:
        state["t"] += rng.randrange(1, 5_000_000)  # up to 5 ms between marks, in ns
        return state["t"]

    return now


def script(seed: int, n_ops: int = 3000) -> list[tuple]:
    """A random but well-formed run: steps with switches, repeats, relabels, host phases, polls."""
    rng = random.Random(seed)
    phases = ["h2d", "forward", "backward", "optimizer", "idle", "clip", "ema", "paused", "backward.comm_wait",
              "forward.comm_wait",  # the waits for collectives: their phase's time too
              "data_wait"]  # a micro-batch's fetch: the period's, not the step's
    ops: list[tuple] = []
    step = 0
    while len(ops) < n_ops:
        step += rng.choice([1, 1, 1, 2, 7])  # gaps: skipped and warm-up steps
        if rng.random() < 0.03:
            ops.append(("open", step, rng.choice(phases)))  # an open record dropped by the next open
        ops.append(("open", step, rng.choice(phases)))
        for _ in range(rng.randrange(0, 9)):
            r = rng.random()
            if r < 0.5:
                ops.append(("switch", rng.choice(phases)))
            elif r < 0.65:
                ops.append(("relabel", rng.choice(phases)))
            elif r < 0.75:
                ops.append(("end",))  # the step's end; later ends move it, later spans are between steps
            elif r < 0.8:
                ops.append(("end", rng.choice(phases)))  # ... with a user phase still open after it
            else:
                ops.append(("add_host", rng.choice(["data_wait", "sync_wait"]), rng.random() * 3))
        if rng.random() < 0.05:
            ops.append(("discard",))
        else:
            ops.append(("close", rng.choice([-1.0, rng.random() * 20])))
        if rng.random() < 0.05:
            ops.append(("close", 1.0))  # a step left untimed: no record open
        if rng.random() < 0.05:
            ops.append(("cut",))  # a pause outside a record: the next record's period is the host's
        if rng.random() < 0.02:
            ops.append(("drain",))  # resolved mid-run: what follows follows nothing
        for _ in range(rng.choice([0, 1, 1, 2])):
            ops.append(("poll",))
    ops.append(("drain",))
    ops.append(("flush",))
    return ops


def run(engine, ops: list[tuple]) -> list:
    out: list = []
    for op in ops:
        name, *args = op
        if name == "open" and engine.full:
            got = engine.poll()
            out.append(("poll", got))
            if engine.full:
                continue
        got = getattr(engine, name)(*args)
        if name in ("poll", "drain", "flush", "close"):
            out.append((name, got))
        out.append(("state", engine.is_open, engine.current, engine.pending))
    return out


def same(a, b) -> None:
    """Equal results; floats within 1e-9 relative (Python >= 3.12 sums with compensation)."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    elif isinstance(a, dict):
        assert list(a) == list(b)  # the same phases, in the same first-seen order
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert a == b


@needs_steps
@pytest.mark.parametrize(
    "seed,window,max_pending,lag,per_step",
    [(0, 10, 64, 2, False), (1, 3, 4, 0, True), (2, 50, 8, 2, True), (3, 1, 2, 5, False), (4, 7, 64, 1, True)],
)
def test_c_engine_gives_the_python_engines_results(seed, window, max_pending, lag, per_step):
    ops = script(seed)
    c = native_steps(fake_ns(seed), window, max_pending, lag, per_step)
    py = PyEngine(CountingHostClock(fake_ns(seed)), window=window, max_pending=max_pending, lag=lag, per_step=per_step)
    got_c, got_py = run(c, ops), run(py, ops)
    windows = [r for e in got_c if e[0] in ("poll", "drain", "flush") and e[1] for r in e[1] if r[0] == "window"]
    assert len(windows) > 5 and sum(w[3] for w in windows) > 100  # the script exercised windows
    same(got_c, got_py)


@needs_steps
def test_c_engine_results_only_when_python_has_work():
    ticks = iter(range(0, 10**12, 1_000_000))  # 1 ms per mark
    eng = Steps(lambda: next(ticks), 4, 16, 0)
    polls = []
    for s in range(8):
        eng.open(s, "h2d")
        eng.add_host("data_wait", 0.5)
        eng.add_host("data_wait", 0.25)
        eng.switch("forward")
        eng.switch("forward")  # already running: no mark
        eng.switch("backward")
        assert eng.current == "backward"
        assert eng.close(2.0) is True
        polls.append(eng.poll())
    assert eng.close(1.0) is False  # none open
    assert polls[:3] == [None, None, None]  # window 0 (steps 0-3) is complete only when step 4 resolves
    kind, key, last, steps, cols = polls[4][0]
    assert (kind, key, last, steps) == ("window", 0, 3, 4)
    # period: on the first record the host's (2 ms given), raised to the record's own 3 ms of spans; on the marks'
    # clock from the second, which follows the first: its last mark -> the next one's last (1 ms across + 3 ms)
    assert cols == {"data_wait": [0.75] * 4, "period": [3.0, 4.0, 4.0, 4.0], "h2d": [1.0] * 4, "forward": [1.0] * 4,
                    "backward": [1.0] * 4, "step": [3.0] * 4}
    assert eng.drain() is None
    assert eng.flush()[0][1:4] == (1, 7, 4)
    assert eng.flush() is None


@needs_steps
def test_c_engine_checks_its_arguments():
    with pytest.raises(TypeError, match="callable"):
        Steps(42, 10, 8)
    with pytest.raises(ValueError, match="window"):
        Steps(lambda: 0, 0, 8)
    with pytest.raises(ValueError, match="max_pending"):
        Steps(lambda: 0, 10, 0)
    eng = Steps(lambda: 0, 10, 1, 0)
    with pytest.raises(TypeError, match="phase name must be a str"):
        eng.open(0, 3)
    assert not eng.is_open
    eng.open(0, "h2d")
    assert eng.close(-1.0) and eng.full
    eng.open(1, "h2d")
    with pytest.raises(RuntimeError, match="max_pending"):
        eng.close(-1.0)
    bad = Steps(lambda: "not ns", 10, 4)
    with pytest.raises(TypeError):
        bad.open(0, "h2d")
    with pytest.raises(TypeError, match="after_end"):
        Steps(lambda: 0, 10, 4, after_end=42)
    with pytest.raises(TypeError, match="must return a str"):
        Steps(lambda: 0, 10, 4, after_end=lambda name: 7)


@needs_steps
def test_c_engine_names_spans_after_the_end_once_per_name_by_the_rule_it_is_given():
    """The rule is Python's (``phases.after_end``), asked once per new name: a custom phase after the step's end
    is ``between_steps.<name>``, a built-in one folds into ``between_steps``, before the end both keep theirs."""
    from phase_timer.phases import after_end

    asked: list[str] = []
    ticks = iter(range(0, 10**12, 1_000_000))  # 1 ms per mark
    eng = Steps(lambda: next(ticks), 1, 8, 0, 4, True, after_end=lambda n: asked.append(n) or after_end(n))
    for s in range(2):
        eng.open(s, "forward")
        eng.switch("clip")
        eng.end("clip")  # a user phase open across the end runs on after it
        eng.switch("optimizer")
        eng.close(-1.0)
    got = [r[2] for r in eng.drain() if r[0] == "step"]
    one = {"forward": 1.0, "clip": 1.0, "between_steps.clip": 1.0, "between_steps": 1.0, "step": 2.0}
    assert got == [one, {**one, "period": 5.0}]  # the second follows the first: 1 ms across + 4 ms of spans
    assert sorted(asked) == ["between_steps", "clip", "forward", "optimizer", "paused"]


@needs_steps
def test_c_engine_is_the_default_for_host_and_native_clocks(monkeypatch):
    core = TimingCore(HostClock(), [], window=10, warmup_steps=0, max_pending=8)
    assert isinstance(core._engine, Steps)
    assert core.phase == core._engine.switch  # the C method itself: no Python frame per switch
    assert isinstance(make_engine(FakeClock(), window=10, max_pending=8), PyEngine)  # any other clock
    assert isinstance(make_engine(HostClock(), window=10, max_pending=8, nvtx=True), PyEngine)
    assert isinstance(make_engine(HostClock(), window=10, max_pending=8, traced=True), PyEngine)
    monkeypatch.setenv("PHASE_TIMER_NATIVE", "0")
    assert isinstance(make_engine(HostClock(), window=10, max_pending=8), PyEngine)


def test_python_engine_when_the_extension_is_missing(monkeypatch):
    import phase_timer.timing.engine as engine_module

    monkeypatch.setattr(engine_module, "Steps", None)
    core = TimingCore(HostClock(), [], window=2, warmup_steps=0, max_pending=8)
    assert isinstance(core._engine, PyEngine)
    for s in range(5):
        core.begin_step(s, "forward")
        core.phase("backward")
        core.close()
    totals = core.finish()
    assert totals.steps == 5 and set(totals.phases) == {"forward", "backward", "step", "period"}


def _hand_made(engine, host_ms: float) -> list[dict]:
    """Records on a clock of 1 ms a mark (the fake device's), the host's period given as ``host_ms`` each time."""
    def step(n: int, paused: bool = False) -> None:
        engine.open(n, "h2d")
        engine.switch("forward")
        if paused:
            engine.switch("paused")
            engine.switch("forward")
        engine.end()
        engine.close(host_ms)

    step(0)              # the first: no record before it, the host's period
    step(1)              # follows 0: 1 ms across the fetch + 3 ms of spans
    step(2, paused=True)  # follows 1: 1 + 5 ms of spans, less the paused one (its step: 3 ms)
    engine.cut()         # a pause outside a record
    step(3)              # the host's
    engine.close(host_ms)  # a step left untimed: no record open
    step(5)              # the host's
    step(6)              # follows 5
    engine.open(7, "h2d")
    engine.discard()     # a step dropped
    step(8)              # the host's
    return [r[2] for r in engine.drain() if r[0] == "step"]


def _engine(kind: str):
    if kind == "c" and Steps is None:
        pytest.skip("the C extension is not built")
    ticks = iter(range(0, 10**12, 1_000_000))  # 1 ms a mark
    now = lambda: next(ticks)  # noqa: E731
    return (Steps(now, 100, 16, 0, 4, True) if kind == "c"
            else PyEngine(CountingHostClock(now), window=100, max_pending=16, lag=0, per_step=True))


@pytest.mark.parametrize("kind", ["python", "c"])
def test_period_is_on_the_marks_clock_when_a_record_follows_the_last(kind):
    got = _hand_made(_engine(kind), 3.5)
    assert [(r["step"], r["period"]) for r in got] == [
        (2.0, 3.5), (2.0, 4.0), (3.0, 5.0), (2.0, 3.5), (2.0, 3.5), (2.0, 4.0), (2.0, 3.5)]
    # a host's period short of the record's own time (3 ms of spans) is raised to it
    got = _hand_made(_engine(kind), 0.5)
    assert [r["period"] for r in got] == [3.0, 4.0, 5.0, 3.0, 3.0, 4.0, 3.0]


@needs_steps
@pytest.mark.parametrize("seed", range(4))
def test_no_step_is_longer_than_its_period_when_the_device_runs_behind_the_host(seed):
    # The host's period is tiny (it queues steps far ahead); the marks' clock is the device's, whose steps are
    # long.  No step's period is below its step, on either engine.
    ops = [op if op[0] != "close" else ("close", 0.001) for op in script(seed, 2000)]
    for engine in (native_steps(fake_ns(seed), 5, 64, 2, True),
                   PyEngine(CountingHostClock(fake_ns(seed)), window=5, max_pending=64, lag=2, per_step=True)):
        steps = [r[2] for e in run(engine, ops) if e[0] in ("poll", "drain") and e[1] for r in e[1] if r[0] == "step"]
        timed = [r for r in steps if "period" in r]
        assert len(timed) > 50
        assert all(r["period"] >= r["step"] for r in timed)
