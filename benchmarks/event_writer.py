"""What the TensorBoard writer's C record saves: a window's scalars record, three ways, on the writer thread.

    PYTHONPATH=. python benchmarks/event_writer.py [--tags 60] [--records 2000] [--out FILE]

phase-timer writes its own event file on a thread of its own (``sinks.BackgroundSink`` over ``EventFileSink``),
one record a window (a step, ``per_step=True``).  A record's bytes are made one of three ways:

- ``c_record``: ``_native.event_record``, the whole record in one C call (protobuf's bytes, the TFRecord frame,
  both checksums);
- ``protobuf_c_crc``: tensorboard's protobuf ``Event`` built and serialized in Python, the checksums by
  ``_native.masked_crc32c``;
- ``protobuf_py_crc``: the same with tensorboard's pure-Python checksum (no C extension at all).

The writer thread holds the GIL while it makes a record, so that time is the training thread's too when the two
meet: the figure that matters is the time a record costs, over the steps a record stands for (one window).  The
script prints each way's median µs a record over ``--repeat`` rounds, and µs a step for a window of 20 and 100.
CPU only; no GPU, no file system (the records go to memory).
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import time

sys.path.insert(0, ".")

from phase_timer.outputs.tags import window_scalars  # noqa: E402
from phase_timer.timing.stats import summarize  # noqa: E402

_U64, _U32 = struct.Struct("<Q"), struct.Struct("<I")


def scalars(n_tags: int) -> dict[str, float]:
    """A window's scalars as the core writes them (the phases' mean/p50/p90/max and shares), cut to ``n_tags``."""
    phases = ["step", "period", "data_wait", "h2d", "forward", "backward", "optimizer", "idle", "between_steps"]
    out = window_scalars({p: summarize([1.0 + i * 0.1 + j for j in range(20)]) for i, p in enumerate(phases)})
    tags = sorted(out)
    while len(tags) < n_tags:
        tags.append(f"extra/{len(tags)}")
        out[tags[-1]] = 0.5
    return {t: out[t] for t in tags[:n_tags]}


def ways() -> dict[str, object]:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as py_crc

    from phase_timer import _native

    def protobuf(crc):  # noqa: ANN001, ANN202
        def record(wall: float, step: int, values: dict[str, float]) -> bytes:
            summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
            data = Event(wall_time=wall, step=step, summary=summary).SerializeToString()
            header = _U64.pack(len(data))
            return header + _U32.pack(crc(header)) + data + _U32.pack(crc(data))

        return record

    return {"c_record": _native.event_record, "protobuf_c_crc": protobuf(_native.masked_crc32c),
            "protobuf_py_crc": protobuf(py_crc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tags", type=int, default=60)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    values = scalars(args.tags)
    made = ways()
    first = {name: fn(1.5, 7, values) for name, fn in made.items()}
    same = len(set(first.values())) == 1  # every way writes the same bytes
    lines = [f"# {len(values)} tags a record ({len(first['c_record'])} bytes), {args.records} records a round, "
             f"median of {args.repeat} rounds; the three ways' bytes identical: {same}",
             f"{'way':<16} {'us/record':>10} {'us/step (window 20)':>20} {'us/step (window 100)':>21}"]
    for name, fn in made.items():
        rounds = []
        for _ in range(args.repeat):
            t0 = time.perf_counter_ns()
            for i in range(args.records):
                fn(1.5 + i, i, values)
            rounds.append((time.perf_counter_ns() - t0) / args.records / 1e3)
        us = statistics.median(rounds)
        lines.append(f"{name:<16} {us:>10.2f} {us / 20:>20.3f} {us / 100:>21.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
