"""The Chrome/Perfetto trace: valid trace-event JSON, one box per phase per traced step, in order."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer import PhaseTimer
from phase_timer.outputs.tags import step_tag
from tests.helpers import loader, module_class, read_scalars, trainer
from tests.doors.test_loop import SleepyNet, train

pytestmark = pytest.mark.timeout(300)


def boxes(path: str) -> dict[int, list[dict]]:
    with open(path) as f:
        doc = json.load(f)
    assert set(doc) >= {"traceEvents"}
    by_pid: dict[int, list[dict]] = {}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M")
        if e["ph"] == "X":
            assert {"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
            by_pid.setdefault(e["pid"], []).append(e)
    return {pid: sorted(es, key=lambda e: e["ts"]) for pid, es in by_pid.items()}


def test_plain_loop_trace_has_contiguous_boxes_matching_the_step_values(tmp_path):
    model = SleepyNet(forward_s=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=1, per_step=True,
                            trace_steps=(3, 7), summary=False) as timer:
        train(timer, model, [opt], steps=10)
    path = os.path.join(timer.log_dir, "phase_trace.json")
    tracks = boxes(path)
    assert len(tracks) == 2  # device and host
    per_step = read_scalars(timer.log_dir)
    for events in tracks.values():
        assert [e["args"]["step"] for e in events] == [s for s in range(3, 7) for _ in range(5)]
        assert [e["name"] for e in events] == ["h2d", "forward", "backward", "optimizer", "between_steps"] * 4
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01  # in order, never overlapping
    device = tracks[1]
    for e in device:
        if e["args"]["step"] == 4:
            got = dict(per_step[step_tag(e["name"])])[4]
            assert e["dur"] / 1e3 == pytest.approx(got, abs=0.002)
    for a, b in zip(device, device[1:]):
        if a["args"]["step"] == b["args"]["step"]:
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=0.01)  # contiguous within a step


def test_lightning_trace_goes_next_to_the_logs(tmp_path):
    t = trainer("lightning.pytorch", str(tmp_path), [PhaseTimer(warmup_steps=1, trace_steps=(2, 4))], max_steps=8,
                log_every_n_steps=4)
    t.fit(module_class("lightning.pytorch")(), loader())
    tracks = boxes(os.path.join(t.logger.log_dir, "phase_trace.json"))
    assert [e["args"]["step"] for e in tracks[1]] == [2] * 5 + [3] * 5


@pytest.mark.parametrize("bad", [(5, 5), (-1, 3), [1, 2], (1, 2, 3), (1.0, 2)])
def test_bad_trace_steps_are_refused(bad):
    with pytest.raises(ValueError, match=r"PhaseTimer\(trace_steps=.*`trace_steps` must be"):
        PhaseTimer(trace_steps=bad)
