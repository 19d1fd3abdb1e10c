"""The plain door's hooks in C (``_native.LoopHooks``) against its Python methods: the same loops, the same results.

The host clock is virtual (every reading 37 µs after the last) and the verdict's samples fall at the same
steps, so a hook that did anything else -- another boundary, a boundary skipped, one more or one fewer clock
reading -- changes the totals.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import phase_timer
from phase_timer.run import boundaries as boundaries_mod
from phase_timer.doors import plain_hooks as hooks_mod

pytestmark = pytest.mark.skipif(hooks_mod._LoopHooks is None, reason="the C extension is not built")

KINDS = ("usual", "accumulate", "eval", "phase", "copy", "no_loader", "manual", "checkpoint", "loader_thread",
         "no_grad_step")


def _train(kind: str, log_dir: str) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(30)]
    loader = None if kind == "no_loader" else batches
    kw: dict = dict(log_dir=log_dir, summary=False, warmup_steps=2, per_step=True)
    if kind == "copy":
        kw.update(copy_to_device=True, device="cpu")
    if kind == "manual":
        kw.update(end_step="manual")
    timer = phase_timer.attach(model, opt, loader, **kw)
    assert type(timer._fetch).__name__ == ("builtin_function_or_method" if hooks_mod._LoopHooks else "method")

    def source():
        if kind == "no_loader":
            yield from batches
        elif kind == "loader_thread":  # timer.loader iterated on a thread of its own, a batch when asked (in step)
            ask: queue.Queue = queue.Queue()
            got: queue.Queue = queue.Queue()

            def fetcher() -> None:
                it = iter(timer.loader)
                while ask.get():
                    got.put(next(it, None))

            t = threading.Thread(target=fetcher)
            t.start()
            ask.put(True)
            while (b := got.get()) is not None:
                yield b
                ask.put(True)
            ask.put(False)
            t.join()
        else:
            yield from timer.loader

    with timer:
        for i, (x, y) in enumerate(source()):
            if kind == "no_grad_step" and i % 7 == 3:  # a forward with grad off, in train mode, inside a step
                with torch.no_grad():
                    model(x)
            if kind == "checkpoint":  # reentrant: the forward runs again inside backward
                x = x.requires_grad_()
                out = checkpoint(model, x, use_reentrant=True)
            else:
                out = model(x)
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            if kind == "accumulate" and i % 2 == 0:
                continue
            if kind == "phase":
                with timer.phase("clip"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if kind == "manual":
                timer.end_step()
            if kind == "eval" and i % 5 == 4:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
    totals = timer.totals
    assert totals is not None
    phases = {p: (t.count, round(t.total, 9), round(t.min, 9), round(t.max, 9)) for p, t in totals.phases.items()}
    return totals.steps, phases, timer.sync_census


@pytest.mark.parametrize("kind", KINDS)
def test_the_hooks_in_c_do_what_the_python_methods_do(kind, tmp_path, monkeypatch):
    results = []
    # The first run of a process meets lazy first-time work (imports) that reads the clock: a throwaway one first.
    for native in (True, True, False):
        ticks = itertools.count()
        with monkeypatch.context() as m:
            m.setattr(time, "perf_counter_ns", lambda: 1_000_000_000 + next(ticks) * 37_000)
            # the verdict's samples at the same steps
            m.setattr(boundaries_mod, "random", SimpleNamespace(Random=lambda: random.Random(0)))
            if not native:
                m.setattr(hooks_mod, "_LoopHooks", None)
            # A loader iterated on another thread is said, on that thread, by both (the warning is the thread's)
            said = (pytest.warns(RuntimeWarning, match="timer.loader is iterated on a thread other than the training")
                    if kind == "loader_thread" else contextlib.nullcontext())
            with said:
                results.append(_train(kind, str(tmp_path / str(native))))
    _, c, py = results
    assert c[0] > 5 or kind == "loader_thread"
    assert c == py



def test_a_closed_timer_lets_go_of_its_run(tmp_path):
    """close() drops the C hooks, which hold the boundaries and the timer itself (a cycle): a closed timer a user
    keeps (for its totals) holds no boundaries, core or engine, and one let go is freed without the cyclic
    collector, as with the Python methods."""
    import gc
    import weakref

    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, None, log_dir=str(tmp_path), summary=False, warmup_steps=1)
    assert type(timer._on_forward).__name__ == "builtin_function_or_method"
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    timer.close()
    assert timer.totals is not None and timer.totals.steps > 0
    assert not set(hooks_mod._HOOK_BODIES) & set(timer.__dict__)
    ref = weakref.ref(timer)
    gc.disable()
    try:
        del timer
        assert ref() is None, "the closed timer is only freed by the cyclic collector"
    finally:
        gc.enable()
