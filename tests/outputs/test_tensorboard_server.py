"""A real TensorBoard server on loopback shows what a real run wrote (through its HTTP data API)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from phase_timer import PhaseTimer
from tests.helpers import loader, module_class, read_scalars, trainer

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, **query: str) -> object:
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def server(tmp_path):
    t = trainer("lightning.pytorch", str(tmp_path), [PhaseTimer(warmup_steps=1)], max_steps=20, log_every_n_steps=5)
    t.fit(module_class("lightning.pytorch")(), loader())
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    run = t.logger.log_dir[len(str(tmp_path)) + 1:]
    try:
        deadline = time.monotonic() + 90
        while True:  # bounded wait until the server has loaded the run
            try:
                if run in _get(port, "/data/plugin/scalars/tags"):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard did not come up: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        yield port, run, t.logger.log_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_scalars_and_layout_through_the_server(server):
    port, run, log_dir = server
    tags = _get(port, "/data/plugin/scalars/tags")[run]
    expected = read_scalars(log_dir)
    phase_tags = sorted(t for t in expected if t.startswith("phase_time/"))
    assert phase_tags and all(t in tags for t in phase_tags)
    for tag in ("phase_time/forward_ms/mean", "phase_time/step_ms/p90"):
        served = _get(port, "/data/plugin/scalars/scalars", run=run, tag=tag)
        assert [(s, pytest.approx(v, rel=1e-6)) for _, s, v in served] == expected[tag]
        assert [s for _, s, _ in served] == [4, 9, 14, 19]
    layout = _get(port, "/data/plugin/custom_scalars/layout")
    charts = {c["title"]: c["multiline"]["tag"] for cat in layout["category"] for c in cat["chart"]}
    assert charts["mean per phase (ms)"] == [r"^phase_time/.*_ms/mean$"]
