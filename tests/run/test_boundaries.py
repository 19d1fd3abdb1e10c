"""Boundaries, driven directly on the host clock: the corner cases the doors reach rarely.

The host clock here is virtual: ``time.perf_counter_ns`` is replaced for the test by a
counter that only :func:`nap` moves, so every figure is exact and a loaded CI machine
(where a 2 ms sleep can take 8) cannot move it. The core, the boundaries and the engine
(C or Python) all read that one function, so they see the same virtual time.
"""

from __future__ import annotations

import time

import pytest

from phase_timer.run.boundaries import Boundaries
from phase_timer.timing.clock import HostClock
from phase_timer.run.core import TimingCore

_now = [0]


def nap(ms: float) -> None:
    _now[0] += round(ms * 1e6)


@pytest.fixture(autouse=True)
def virtual_time(monkeypatch):
    _now[0] = 1_000_000_000
    monkeypatch.setattr(time, "perf_counter_ns", lambda: _now[0])


def run(drive) -> dict[str, list[float]]:
    """Each phase's per-step values, from a real core on the (virtual) host clock."""
    got: dict[str, list[float]] = {}

    class Collect:
        def write(self, step, scalars):
            for tag, v in scalars.items():
                if tag.startswith("phase_time_step/"):
                    got.setdefault(tag.split("/")[1].removesuffix("_ms"), []).append(v)

        def flush(self):
            pass

        def close(self):
            pass

    core = TimingCore(HostClock(), [Collect()], window=100, warmup_steps=0, max_pending=8, per_step=True)
    bounds = Boundaries(core)
    drive(bounds)
    bounds.finish()
    core.finish()
    return got


def micro_batch(b: Boundaries, *, fetch_twice: bool = False, broadcast_ms: float = 0.0) -> None:
    b.fetch()
    if fetch_twice:  # Lightning under DDP: its broadcast, then its fetch, report the same fetch
        nap(broadcast_ms)
        b.fetch()
    b.batch(sync_wait_ms=broadcast_ms)
    b.copied()
    nap(2)
    b.backward_start()
    nap(2)
    b.backward_end()


def test_a_second_fetch_report_before_the_batch_changes_nothing():
    def drive(b: Boundaries) -> None:
        for _ in range(3):
            micro_batch(b, fetch_twice=True, broadcast_ms=5)
            micro_batch(b, fetch_twice=True, broadcast_ms=5)  # accumulation: two micro-batches
            b.optimizer_start()
            b.step_end()

    got = run(drive)
    assert len(got["step"]) == 3
    assert got["sync_wait"] == pytest.approx([10.0] * 3)  # one broadcast per micro-batch, counted once
    assert got["idle"] == pytest.approx([0.0] * 3)  # the broadcast is not the device's idle time
    assert got["step"] == pytest.approx([8.0] * 3)  # two micro-batches of 2 + 2
    assert got["period"] == pytest.approx([18.0] * 2)  # the broadcasts are in the period, not the step


def test_period_after_a_dropped_batch_does_not_carry_it():
    def drive(b: Boundaries) -> None:
        for i in range(4):
            micro_batch(b)
            if i == 2:  # its backward raised; the loop skips the batch
                b.in_backward = True
                b.backward_end(failed=True)
                nap(30)
                continue
            b.optimizer_start()
            b.step_end()

    got = run(drive)
    assert len(got["step"]) == 3  # the failed batch is dropped
    assert got["period"] == pytest.approx([4.0, 4.0]), got["period"]  # and no period holds its 30 ms


def test_a_user_phase_open_across_the_end_runs_on_after_it_as_between_steps_name():
    """Its part inside the step keeps its name and is the step's; its part after the end is
    ``between_steps.stepping``, outside the step: each name is of one total."""
    def drive(b: Boundaries) -> None:
        for _ in range(3):
            micro_batch(b)
            b.enter("stepping")
            nap(3)
            b.optimizer_start()
            b.step_end()
            b.step_end()  # a GradScaler's update right after
            nap(5)
            b.exit()
            nap(1)

    got = run(drive)
    assert "between_steps" in got
    for i in range(3):
        assert got["stepping"][i] == pytest.approx(3.0)  # inside the step
        assert got["between_steps.stepping"][i] == pytest.approx(5.0)  # after its end
        assert got["step"][i] == pytest.approx(4 + 3)  # the 5 ms after the end are not the step's
        assert got["between_steps"][i] == pytest.approx(1.0)
    assert got["period"] == pytest.approx([13.0, 13.0])


# -- the usual boundaries in C (`_native.Fast`) against the Python ones ------------------------------------
_SLOTS = ("open", "ended", "trailing", "paused", "in_backward", "_auto", "_after_backward", "_saw_forward",
          "_saw_backward", "_failed", "_fetched", "steps", "begun", "_mem_on", "_mem_due", "_step")


def _script(seed: int, n: int = 1500) -> list[tuple]:
    """Mostly usual steps, with what makes a boundary unusual mixed in: pauses, user phases, accumulation,
    a second backward or optimizer, a forward inside backward, a failed backward, ends with nothing open."""
    import random

    rng = random.Random(seed)
    ops: list[tuple] = []
    depth = 0
    usual = ["fetch", "batch", "copied", "forward", "backward_start", "backward_end", "optimizer_start", "step_end"]
    while len(ops) < n:
        if rng.random() < 0.7:  # a usual step, sometimes cut short
            for name in usual[: rng.choice([8, 8, 8, 8, 5, 6, 3])]:
                if name == "batch" and rng.random() < 0.2:
                    ops.append(("batch_at", len(ops)))  # the door gives the step's index (Lightning's)
                else:
                    ops.append((name, rng.random() < 0.02) if name == "backward_end" else (name,))
            continue
        r = rng.random()
        if r < 0.15:
            ops.append(("pause",))
        elif r < 0.3:
            ops.append(("resume",))
        elif r < 0.4:
            ops.append(("enter", rng.choice(["clip", "ema"])))
            depth += 1
        elif r < 0.5 and depth:
            ops.append(("exit",))
            depth -= 1
        elif r < 0.6:
            ops.append(("micro_batch_end",))
        elif r < 0.65:
            ops.append(("epoch_end",))
        elif r < 0.7:
            ops.append(("drop",))
        else:
            name = rng.choice(usual)
            ops.append((name, rng.random() < 0.3) if name == "backward_end" else (name,))
    return ops


def _replay(ops: list[tuple], native: bool, seed: int, memory: bool) -> tuple[list, dict]:
    import random

    from phase_timer.measures import memory as memory_mod
    from tests.fakes import FakeAllocator

    written: list = []

    class Collect:
        def write(self, step, scalars):
            written.append((step, sorted(scalars.items())))

        def flush(self):
            pass

        def close(self):
            pass

    _now[0] = 1_000_000_000
    alloc = FakeAllocator()
    reader_for = memory_mod.reader_for
    if memory:  # memory steps too (their boundaries read an allocator: a fake one here)
        memory_mod.reader_for = lambda clock: (alloc.read, alloc.info)
    try:
        clock = HostClock()
        core = TimingCore(clock, [Collect()], window=7, warmup_steps=3, max_pending=64, per_step=True,
                          measures=memory_mod.Memory.listening(clock))
    finally:
        memory_mod.reader_for = reader_for
    assert (core.memory is not None) == memory
    if memory:
        core.memory._rng = random.Random(seed)  # memory steps at the same steps in both runs
    core._flight = True  # the steps in flight counted as on a device clock (the host engine answers 0)
    b = Boundaries(core)
    b._hot(core._engine, native=native)
    assert (type(b.on_forward).__name__ == "builtin_function_or_method") == native
    b._rng, b._sample_in = random.Random(seed), 4  # the verdict's samples at the same steps in both runs
    calls = {"forward": b.on_forward, "copied": b.on_copied, "backward_start": b.on_backward_start,
             "backward_end": b.on_backward_end, "optimizer_start": b.on_optimizer_start, "step_end": b.on_step_end,
             "fetch": b.on_fetch, "batch": lambda: b.on_batch(None, 0.25), "batch_at": lambda n: b.on_batch(n, None, 0.5)}
    states = []
    for i, (name, *args) in enumerate(ops):
        nap(0.5 + (i * 7919 % 13) / 10)
        call = calls.get(name) or getattr(b, name)
        call(*args)
        alloc.alloc(1)
        states.append((name, type(b).__name__, list(b._explicit), *(getattr(b, s) for s in _SLOTS),
                       b._flight_at, b._sample_in, core._poll_in, core._in_step, core.steps_begun, core._flight_n,
                       core._last_end is None))
    b.finish()
    core.finish()
    out = {"written": written, "steps": core.totals.steps, "samples": len(core.signals.own_ns),
           "memory": core.memory_summary(), "flight": dict(core.signals.flight), "tail": core.signals.tail_checked}
    return states, out


@pytest.mark.skipif(Boundaries(TimingCore(HostClock(), window=5, warmup_steps=0, max_pending=4)).on_forward.__class__
                    .__name__ != "builtin_function_or_method", reason="the C extension is not built")
@pytest.mark.parametrize("seed", range(8))
def test_the_usual_boundaries_in_c_do_what_the_python_ones_do(seed):
    ops = _script(seed)
    memory = seed % 2 == 1
    # The random script has optimizer steps with no backward() before them: both warn, and say the same.
    with pytest.warns(RuntimeWarning, match="an optimizer step began with no `backward\\(\\)` call seen") as c_said:
        c_states, c_out = _replay(ops, native=True, seed=seed, memory=memory)
    with pytest.warns(RuntimeWarning, match="an optimizer step began with no `backward\\(\\)` call seen") as py_said:
        py_states, py_out = _replay(ops, native=False, seed=seed, memory=memory)
    assert [str(w.message) for w in c_said] == [str(w.message) for w in py_said]
    assert c_out["steps"] > 50 and c_out["samples"] > 3  # the script timed steps, sampled ones among them
    assert sum(c_out["flight"].values()) > 5  # and counted the steps in flight at some closes
    assert {s[1] for s in c_states} == {"Boundaries", "_SampledBoundaries"}
    for i, (c, p) in enumerate(zip(c_states, py_states)):
        assert c == p, (i, ops[max(0, i - 5): i + 1])
    assert c_out == py_out


def test_an_evaluation_between_two_micro_batches_is_in_no_phase_nor_period():
    def drive(b: Boundaries) -> None:
        for _ in range(3):
            micro_batch(b)
            b.pause()  # the plain door's evaluation: a no-grad forward in eval mode
            nap(100)
            micro_batch(b)  # its fetch ends the pause
            b.optimizer_start()
            nap(1)
            b.step_end()

    got = run(drive)
    assert got["step"] == pytest.approx([9.0] * 3)  # two micro-batches of 2 + 2, the optimizer's 1
    assert got["period"] == pytest.approx([9.0] * 2)
