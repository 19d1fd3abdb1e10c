"""The C pieces (phase_timer/_native.c and its parts in phase_timer/native/) and what stands in for them, on the CPU.

The native clock itself needs a GPU (tests/test_gpu.py); here: the build, the
record checksum, the own event file read back by tensorboard, the fallbacks, and
the window statistics the speed-ups rewrote.
"""

from __future__ import annotations

import math
import os
import random
import struct
from collections import Counter

import pytest
import torch

from phase_timer.timing import clock as clock_mod
from phase_timer.outputs.sinks import EventFileSink, open_event_file
from phase_timer.timing.stats import _INV_LOG_GROWTH, _ZERO, PhaseTotals, Window

try:
    from phase_timer import _native as native
except ImportError:  # the pure-Python tests below still run
    native = None
needs_native = pytest.mark.skipif(native is None, reason="the C extension is not built here")


@needs_native
def test_masked_crc32c_matches_tensorboards():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    rng = random.Random(0)
    for n in (0, 1, 3, 8, 12, 255, 961, 4096):
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert native.masked_crc32c(data) == reference(data), n
    assert native.masked_crc32c(memoryview(b"abc")) == reference(b"abc")
    with pytest.raises(TypeError):
        native.masked_crc32c("not bytes")


def _records(path: str) -> list[bytes]:
    """TFRecord framing, every checksum checked with tensorboard's own (pure-Python) CRC."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    out = []
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos < len(blob):
        header = blob[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", blob[pos + 8 : pos + 12])[0] == reference(header)
        data = blob[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", blob[pos + 12 + length : pos + 16 + length])[0] == reference(data)
        out.append(data)
        pos += 16 + length
    return out


@pytest.mark.parametrize("in_c", [True, False])
def test_event_file_is_read_back_by_tensorboard(tmp_path, in_c):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.proto.event_pb2 import Event

    sink = EventFileSink(str(tmp_path), layout={"phase-timer": {}}, flush_s=3600)
    if not in_c:
        sink._scalars_record = None  # protobuf's own objects
    elif sink._scalars_record is None:
        pytest.skip("the C extension is not built here")
    sink.write(10, {"phase_time/forward_ms/mean": 1.5, "phase_time/step_ms/mean": 4.25})
    sink.write(20, {"phase_time/forward_ms/mean": 2.5})
    sink.close()
    records = [Event.FromString(r) for r in _records(sink.path)]
    assert records[0].file_version == "brain.Event:2"
    assert [r.step for r in records[2:]] == [10, 20]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("phase_time/forward_ms/mean")] == [(10, 1.5), (20, 2.5)]
    assert [e.value for e in acc.Scalars("phase_time/step_ms/mean")] == [4.25]


@needs_native
def test_a_scalars_record_in_c_is_protobufs_own_bytes():
    """event_record writes what protobuf's serializer and the TFRecord framing write, byte for byte: a zero step
    and an empty tag left out (proto3), the summary and every simple_value kept (oneof members), floats rounded
    to float32 as protobuf rounds them, negative and large steps, non-ASCII tags, inf and nan."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    def reference(wall: float, step: int, scalars: dict) -> bytes:
        summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in scalars.items()])
        data = Event(wall_time=wall, step=step, summary=summary).SerializeToString()
        head = struct.pack("<Q", len(data))
        crc = native.masked_crc32c
        return head + struct.pack("<I", crc(head)) + data + struct.pack("<I", crc(data))

    rng = random.Random(0)
    cases = [(1.7e9, 0, {}), (1.0, -3, {"": 2.0, "é/ü_ms": float("inf")}), (12.5, 2**40, {"n": float("nan"), "i": 3}),
             (0.0, 1, {"a": 1.0}), (-0.0, 0, {"a": -0.0}), (1.0, 1, {"over": 1e39, "nul\x00tag": 2.0}),
             (1.7e9, 10, {"phase_time/forward_ms/mean": 1.25, "zero": 0.0, "tiny": 1e-42, "huge": 1e300})]
    for _ in range(200):
        tags = {f"phase_time/{rng.choice('abcdefgh') * rng.randint(1, 40)}_ms/{i}": rng.uniform(-1e6, 1e6)
                for i in range(rng.randint(0, 60))}
        cases.append((rng.uniform(0, 2e9), rng.randint(-(2**63), 2**63 - 1), tags))
    for case in cases:
        assert native.event_record(*case) == reference(*case), case[:2]
    with pytest.raises(TypeError, match="a tag must be a str"):
        native.event_record(1.0, 1, {3: 1.0})

    class Grows:  # a value whose conversion changes the dict being written: the items taken first hold
        def __float__(self) -> float:
            scalars.update({f"k{i}": 0.0 for i in range(200)})
            scalars.pop("b", None)
            return 1.0

    scalars = {"a": Grows(), "b": 2.0}
    assert native.event_record(1.0, 1, scalars) == reference(1.0, 1, {"a": 1.0, "b": 2.0})


def test_event_file_flushes_by_time_and_on_close(tmp_path):
    sink = EventFileSink(str(tmp_path), flush_s=3600)
    size0 = os.path.getsize(sink.path)
    sink.write(1, {"a": 1.0})
    assert os.path.getsize(sink.path) == size0  # buffered: no write per window
    sink._next_flush = 0.0  # the flush interval is over
    sink.write(2, {"a": 2.0})
    size2 = os.path.getsize(sink.path)
    assert size2 > size0
    sink.write(3, {"a": 3.0})
    sink.close()
    assert os.path.getsize(sink.path) > size2 and len(_records(sink.path)) == 4
    sink.close()  # twice is fine


def test_the_default_event_file_is_written_off_the_training_thread(tmp_path):
    from phase_timer.outputs.sinks import BackgroundSink

    sink = open_event_file(str(tmp_path), per_step=False)
    assert isinstance(sink, BackgroundSink)  # a slow file system never holds a step
    sink.write(7, {"phase_time/step_ms/mean": 3.0})
    sink.close()
    path = sink.sink.sink.path
    assert len(_records(path)) == 3  # version, layout, the window: all written and closed


@needs_native
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_native_clock_without_a_driver_fails_clearly():
    with pytest.raises((OSError, RuntimeError), match="libcuda|cuInit|cuDevice"):
        native.Clock(0, lambda index: 0)


def test_make_clock_falls_back_to_torch_events(monkeypatch, caplog):
    class Broken:
        def __init__(self, device):
            raise OSError("libcuda.so.1 has no cuEventRecord")

    class TorchEvents:
        def __init__(self, device):
            self.device = device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(clock_mod, "NativeCudaClock", Broken)
    monkeypatch.setattr(clock_mod, "CudaClock", TorchEvents)
    with caplog.at_level("INFO", logger="phase_timer.timing.clock"):
        assert isinstance(clock_mod.make_clock("cuda:0"), TorchEvents)
    assert "cuEventRecord" in caplog.text
    monkeypatch.setenv("PHASE_TIMER_NATIVE", "0")
    assert not clock_mod.native_wanted()


def test_histogram_by_runs_equals_one_log_per_value():
    rng = random.Random(1)
    values = [rng.lognormvariate(1.0, 0.05) for _ in range(3000)] + [rng.uniform(0.001, 80) for _ in range(3000)]
    edges = [1.01**k for k in range(-50, 400, 7)]
    values += [0.0] * 7 + edges + [math.nextafter(e, 0.0) for e in edges] + [math.nextafter(e, 1e9) for e in edges]
    totals = PhaseTotals()
    for i in range(0, len(values), 50):  # a window at a time, as the core feeds it
        totals.extend(values[i : i + 50])
    want = Counter(math.floor(math.log(v) * _INV_LOG_GROWTH) if v > 0 else _ZERO for v in values)
    got = totals._buckets
    assert got == dict(want)  # the same buckets, values beside the edges included
    assert totals.count == len(values) and totals.min == 0.0 and totals.max == max(values)
    assert totals.total == pytest.approx(sum(values))


def test_window_columns_with_and_without_the_same_phases():
    w = Window(0)
    for s in range(5):
        w.add(s, {"forward": 5.0 - s, "step": 10.0 + s})
    assert w.values == {"forward": [5.0, 4.0, 3.0, 2.0, 1.0], "step": [10.0, 11.0, 12.0, 13.0, 14.0]}
    assert w.columns()["forward"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    mixed = Window(0)
    mixed.add(0, {"forward": 1.0, "step": 2.0})
    mixed.add(1, {"forward": 3.0, "clip": 0.5})  # same size, other phases
    mixed.add(2, {"forward": 2.0, "step": 4.0, "clip": 0.25})
    assert mixed.values == {"forward": [1.0, 3.0, 2.0], "step": [2.0, 4.0], "clip": [0.5, 0.25]}
    summary = mixed.summary()
    assert summary["clip"]["max"] == 0.5 and summary["forward"]["p50"] == 2.0


def test_the_c_close_reads_the_clock_that_python_reads(monkeypatch):
    """The usual close in C reads time.perf_counter_ns's own clock without calling it, and a replaced one by
    calling it (a test's virtual clock): the step's period is on the host clock the rest of the core reads."""
    import time

    from phase_timer.run.boundaries import Boundaries
    from phase_timer.timing.clock import HostClock
    from phase_timer.run.core import TimingCore

    core = TimingCore(HostClock(), window=5, warmup_steps=0, max_pending=8)
    b = Boundaries(core)
    if type(b.on_fetch).__name__ != "builtin_function_or_method":
        pytest.skip("the C extension is not built")

    def step() -> None:
        b.on_batch(None, None)
        b.on_copied()
        b.on_backward_start()
        b.on_backward_end(False)
        b.on_optimizer_start()
        b.on_step_end()

    for _ in range(3):
        b.on_fetch()
        step()
    b._sample_in = 1000  # no sampled step next: the close takes the C path
    closed = b.steps
    t0 = time.perf_counter_ns()
    b.on_fetch()
    t1 = time.perf_counter_ns()
    assert b.steps == closed + 1 and t0 <= core._last_end <= t1
    step()
    monkeypatch.setattr(time, "perf_counter_ns", lambda: t1 + 5_000_000)
    b.on_fetch()
    assert core._last_end == t1 + 5_000_000
    b.finish()
    core.finish()


def test_the_slots_the_c_reads_are_its_classes_own_declarations():
    """``_native.Fast`` and ``_native.LoopHooks`` take the offsets of the slots they read from the classes' own
    tuples (``FAST_SLOTS``, ``HOOK_SLOTS``): each name is a slot of its class, and a declaration the C cannot use
    (a name short, or one that is not a slot) fails where the C is made, naming the class, the tuple and the name."""
    from phase_timer.doors.plain_hooks import PlainHooks
    from phase_timer.run.boundaries import Boundaries
    from phase_timer.run.core import TimingCore

    for cls, attr in ((Boundaries, "FAST_SLOTS"), (Boundaries, "HOOK_SLOTS"), (TimingCore, "FAST_SLOTS"),
                      (PlainHooks, "HOOK_SLOTS")):
        names = getattr(cls, attr)
        assert isinstance(names, tuple) and len(set(names)) == len(names) > 4, (cls, attr)
        assert set(names) <= set(cls.__slots__), (cls, attr, set(names) - set(cls.__slots__))
    if native is None:
        pytest.skip("the C extension is not built here")

    def fast(bounds: Boundaries) -> object:
        return native.Fast(bounds, core._engine, ("forward", "backward", "optimizer", "between_steps", "h2d",
                                                  "data_wait", "sync_wait"), __import__("time"), lambda: None, 8)

    core = TimingCore(clock_mod.HostClock(), window=5, warmup_steps=0, max_pending=8)
    fast(Boundaries(core))  # the classes' own declarations: made

    class Short(Boundaries):
        __slots__ = ()
        FAST_SLOTS = Boundaries.FAST_SLOTS[:-1]

    class NotASlot(Boundaries):
        __slots__ = ()
        FAST_SLOTS = (*Boundaries.FAST_SLOTS[:-1], "no_such_slot")

    with pytest.raises(TypeError, match=r"Short\.FAST_SLOTS is not a tuple of 24 slot names"):
        fast(Short(core))
    with pytest.raises(TypeError, match=r"NotASlot\.FAST_SLOTS\[23\] \('no_such_slot'\) is not a writable slot"):
        fast(NotASlot(core))
    core.finish()


def test_each_declared_slot_stands_where_the_c_enum_names_it():
    """The C reads a declared tuple by position (its enums in ``native/fast.c`` and ``native/loop_hooks.c``): each
    position's enum name is the slot's own, upper-cased (``S_SAW_FORWARD``: ``_saw_forward``; ``C_BEGUN``:
    ``steps_begun``), so a reordered tuple, which the twins' tests may not notice, fails here."""
    import pathlib
    import re

    from phase_timer.doors.plain_hooks import PlainHooks
    from phase_timer.run.boundaries import Boundaries
    from phase_timer.run.core import TimingCore

    native_dir = pathlib.Path(clock_mod.__file__).parent.parent / "native"
    enums = {}
    for part in ("fast.c", "loop_hooks.c"):
        for body in re.findall(r"enum \{([^}]*)\}", (native_dir / part).read_text()):
            members = [m.strip() for m in body.split(",") if m.strip()]
            enums[members[-1]] = members[:-1]  # keyed by its count: N_SLOTS, N_CSLOTS, ...
    for names, count in ((Boundaries.FAST_SLOTS, "N_SLOTS"), (TimingCore.FAST_SLOTS, "N_CSLOTS"),
                         (PlainHooks.HOOK_SLOTS, "N_LSLOTS"), (Boundaries.HOOK_SLOTS, "N_BSLOTS")):
        members = enums[count]
        assert len(members) == len(names), count
        for i, (name, member) in enumerate(zip(names, members)):
            assert name.lstrip("_").upper().endswith(member.split("_", 1)[1]), (count, i, name, member)
