"""FLOPs and MFU under the runs a demanding user has (CPU, real components): a count never leaves
FlopCounterMode, ``force_eager`` or its global module hooks behind, and a counted step's time lands nowhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import phase_timer
from tests.helpers import hours_per_step

B, D_IN, D_H, D_OUT = 6, 24, 40, 8


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_OUT))
    return model, torch.optim.SGD(model.parameters(), 0.01)


def _batch(b=B):
    return torch.randn(b, D_IN), torch.randint(0, D_OUT, (b,))


def _mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def test_a_count_begun_on_a_prefetching_thread_leaves_no_force_eager_nor_global_hooks(tmp_path):
    """timer.loader iterated by a prefetching thread (the loop door warns of it and times steps without a loader):
    the first batch's count starts on that thread before the loop's thread is known.  Dropping it from the loop's
    thread must not leave torch.compile's ``force_eager`` stance (global: no compiled code for the rest of the
    run) nor FlopCounterMode's global module hooks on."""
    script = textwrap.dedent(f"""
        import queue, threading, warnings
        import torch
        from torch import nn
        import torch.nn.modules.module as m
        import phase_timer
        from torch._dynamo import eval_frame

        warnings.simplefilter("ignore")
        hooks0 = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8))
        opt = torch.optim.SGD(model.parameters(), 0.01)
        batches = [(torch.randn(6, 24), torch.randint(0, 8, (6,))) for _ in range(12)]
        with phase_timer.attach(model, opt, batches, log_dir={str(tmp_path)!r}, warmup_steps=2, summary=False,
                                peak_tflops=0.01) as timer:
            q = queue.Queue(maxsize=2)
            def fill():
                for b in timer.loader:
                    q.put(b)
                q.put(None)
            th = threading.Thread(target=fill)
            th.start()
            while (b := q.get()) is not None:
                x, y = b
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            th.join()
        print("STANCE", eval_frame._stance.stance)
        print("HOOKS", (len(m._global_forward_pre_hooks), len(m._global_forward_hooks)) == hooks0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STANCE default" in out.stdout, out.stdout
    assert "HOOKS True" in out.stdout, out.stdout


def test_an_interrupted_counted_step_that_follows_a_sampled_one_leaves_no_dispatch_mode_on(tmp_path, monkeypatch):
    """The step after a verdict's sampled step carries the own-cost sample's wrappers on the instance (its
    ``finish`` among them, bound to the plain class's).  When that step is a new shape's counted step and the
    loop raises in it (a step-based loop holding its iterator: the loader is not closed first), close() must
    still leave FlopCounterMode: else every op after it, in this process, runs under the mode."""
    monkeypatch.setattr("phase_timer.run.boundaries.sample_gap", lambda rng, n: 2)
    model, opt = _mlp()
    holder: dict = {}

    class Loader:  # a new shape on the first step that is an ordinary step's own-cost sample
        def __iter__(self):
            for _ in range(40):
                bounds = holder["timer"]._bounds
                sampled = "finish" in vars(bounds) and bounds.steps > 2
                yield _batch(2 * B if sampled else B)

    plan = None
    try:
        try:
            with phase_timer.attach(model, opt, Loader(), log_dir=tmp_path, warmup_steps=2, summary=False,
                                    peak_tflops=0.01) as timer:
                holder["timer"] = timer
                plan = timer._bounds.flops
                it = iter(timer.loader)
                while True:
                    x, y = next(it)
                    loss = nn.functional.cross_entropy(model(x), y)
                    if x.shape[0] == 2 * B:
                        raise KeyboardInterrupt  # Ctrl-C in the (slow) counted step
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        except KeyboardInterrupt:
            pass
        assert plan is not None and plan.counter.counting is False
        assert _mode() is None
    finally:
        if plan is not None and plan.counter._stack is not None:  # leave this process as it was
            plan.counter.close()


def test_the_counted_steps_time_is_in_no_timed_steps_period(tmp_path, host_hours):
    """With no warm-up, the first step is counted and untimed: an hour planted between its optimizer step and the
    next fetch (its own between_steps) is in no timed step's period."""
    from tests.helpers import pause

    model, opt = _mlp()
    batches = [_batch() for _ in range(12)]
    with phase_timer.attach(model, opt, batches, log_dir=tmp_path, warmup_steps=0, window=100, summary=False,
                            peak_tflops=0.01) as timer:
        for i, (x, y) in enumerate(timer.loader):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                pause(0.001)  # one planted hour
    assert timer.totals.steps == 11
    assert hours_per_step(timer.totals)["period"] == 0


@pytest.mark.xfail(strict=True, reason="review: not fixed -- split_counts drops a window's FLOPs when any step lacks "
                   "them, and the engine's columns are sorted (no step alignment to sum the counted steps' period)")
def test_past_max_shapes_the_counted_shapes_steps_still_give_mfu(tmp_path):
    """More shapes than MAX_SHAPES (bucketed sequence lengths): the warning says the uncounted shapes' steps are
    left out of MFU; the counted shapes' steps, most of the run, must still give it."""
    from phase_timer.measures.flops import MAX_SHAPES

    model, opt = _mlp()
    sizes = [B + i for i in range(MAX_SHAPES + 1)]  # one shape more than is counted
    batches = [_batch(sizes[i % len(sizes)]) for i in range(120)]
    with phase_timer.attach(model, opt, batches, log_dir=tmp_path, warmup_steps=2, window=10, summary=False,
                            peak_tflops=0.01) as timer:
        for x, y in timer.loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    import json

    with open(timer.summary_path) as f:
        flops = json.load(f)["flops"]
    assert flops["mfu"] is not None, flops["note"]
