"""The plain-PyTorch door on the CPU: real loops, real hooks, real TensorBoard files."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import phase_timer
from phase_timer.outputs.tags import step_tag, window_tag
from tests import helpers
from tests.helpers import SlowSGD, hours, hours_per_step, loader, open_files_under, read_scalars, slow_backward

pytestmark = pytest.mark.timeout(300)


class SleepyNet(nn.Module):
    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        helpers.pause(self.forward_s)
        return slow_backward(self.net(x), self.backward_s)


def hook_state(model: nn.Module, opts, scaler=None):
    return (
        [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()],
        [(dict(o._optimizer_step_pre_hooks), dict(o._optimizer_step_post_hooks)) for o in opts],
        None if scaler is None else sorted(scaler.__dict__),  # keys: no method patched in
    )


def train(timer, model, opts, steps, *, accumulate=1, loss_fn=None):
    n = 0
    for i, (x, y) in enumerate(timer.loader):
        loss = (loss_fn or nn.functional.mse_loss)(model(x), y) / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            n += 1
            if n == steps:
                break


def test_phases_land_where_the_time_is_spent_and_reach_tensorboard(tmp_path, host_hours):
    model = SleepyNet(forward_s=0.003, backward_s=0.006)
    opt = SlowSGD(model.parameters(), lr=0.01, sleep_s=0.008)
    with phase_timer.attach(model, opt, loader(sleep_s=0.0005), log_dir=tmp_path, window=5, warmup_steps=2) as timer:
        train(timer, model, [opt], steps=22)
    # Every step: its planted hours where they were planted (8 items of 0.5 in the fetch), and nowhere else.
    assert hours_per_step(timer.totals) == {"data_wait": 4, "h2d": 0, "forward": 3, "backward": 6, "optimizer": 8,
                                            "between_steps": 0, "step": 17, "period": 21}
    assert timer.totals.steps == 20
    scalars = read_scalars(timer.log_dir)
    assert [s for s, _ in scalars[window_tag("forward", "p90")]] == [4, 9, 14, 19, 21]
    for phase in ("data_wait", "h2d", "forward", "backward", "optimizer", "step", "period"):
        assert window_tag(phase, "mean") in scalars
    assert open_files_under(str(tmp_path)) == []


def test_gradient_accumulation_sums_micro_batches(tmp_path, host_hours):
    model = SleepyNet(forward_s=0.003, backward_s=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=1, per_step=True) as timer:
        train(timer, model, [opt], steps=6, accumulate=4)
    scalars = read_scalars(timer.log_dir)
    assert [s for s, _ in scalars[step_tag("step")]] == [1, 2, 3, 4, 5]
    assert {hours(v) for _, v in scalars[step_tag("forward")]} == {4 * 3}  # four micro-batches summed
    assert {hours(v) for _, v in scalars[step_tag("backward")]} == {4 * 2}
    assert step_tag("idle") in scalars
    assert timer.totals.phases["data_wait"].count == 5


def test_bf16_autocast_and_grad_scaler_with_a_skipped_step(tmp_path, host_hours):
    model = SleepyNet()
    opt = SlowSGD(model.parameters(), lr=0.01, sleep_s=0.005)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = hook_state(model, [opt], scaler)
    timer = phase_timer.attach(model, opt, loader(), scaler=scaler, log_dir=tmp_path, warmup_steps=0, per_step=True)
    for i, (x, y) in enumerate(timer.loader):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if i == 3:
            loss = loss * float("inf")  # the scaler skips this step
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == 7:
            break
    timer.close()
    opt_ms = [v for _, v in read_scalars(timer.log_dir)[step_tag("optimizer")]]
    assert len(opt_ms) == 8  # the skipped step still ended, at scaler.update()
    assert [hours(ms) for ms in opt_ms] == [5, 5, 5, 0, 5, 5, 5, 5]  # the skipped step never ran SlowSGD.step
    assert hook_state(model, [opt], scaler) == before


def test_several_optimizers_and_set_to_none(tmp_path, host_hours):
    g, d = SleepyNet(forward_s=0.002), SleepyNet(forward_s=0.002)
    opt_g = SlowSGD(g.parameters(), lr=0.01, sleep_s=0.003)
    opt_d = SlowSGD(d.parameters(), lr=0.01, sleep_s=0.003)
    with phase_timer.attach([g, d], [opt_d, opt_g], loader(), log_dir=tmp_path, warmup_steps=1) as timer:
        for i, (x, y) in enumerate(timer.loader):
            opt_d.zero_grad(set_to_none=False)
            nn.functional.mse_loss(d(x), y).backward()
            opt_d.step()
            opt_g.zero_grad(set_to_none=True)
            nn.functional.mse_loss(g(x), y).backward()
            opt_g.step()
            if i == 9:
                break
    assert timer.totals.steps == 9
    per_step = hours_per_step(timer.totals)
    assert (per_step["optimizer"], per_step["forward"]) == (6, 4)  # both models' steps and forwards, summed


def test_evaluation_between_steps_is_not_counted(tmp_path, host_hours):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    val_x = torch.randn(8, 16)
    with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0) as timer:
        for i, (x, y) in enumerate(timer.loader):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i % 3 == 1:  # not after the last step (i == 11): test_loop_patterns has that one, a known bug
                model.eval()
                with torch.no_grad():
                    model.forward_s = 0.1
                    model(val_x)
                    model.forward_s = 0.0
                model.train()
            if i == 11:
                break
    assert timer.totals.phases["forward"].count == 12
    # 4 of 12 steps are followed by an evaluation of 100 planted hours: in no phase and no period
    assert hours(host_hours.offset_ns / 1e6) == 4 * 100 and set(hours_per_step(timer.totals).values()) == {0}


def test_compiled_model(tmp_path):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        compiled(torch.randn(8, 16)).sum().backward()
    except Exception as err:  # noqa: BLE001 - no compiler toolchain on this CPU build
        pytest.skip(f"torch.compile does not work here: {err}")
    with phase_timer.attach(compiled, opt, loader(), log_dir=tmp_path, warmup_steps=2) as timer:
        train(timer, compiled, [opt], steps=10)
    assert timer.totals.steps == 8
    for phase in ("forward", "backward", "optimizer"):
        assert timer.totals.phases[phase].count == 8


def test_explicit_phases_nest_exclusively_and_still_add_up(tmp_path, host_hours):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, per_step=True) as timer:
        for i, (x, y) in enumerate(timer.loader):
            with timer.phase("loss"):
                loss = nn.functional.mse_loss(model(x), y)  # the forward hook fires inside: loss wins
                helpers.pause(0.002)
                with timer.phase("extra"):
                    helpers.pause(0.003)
            loss.backward()
            opt.step()
            if i == 5:
                break
    per_step = hours_per_step(timer.totals)
    assert (per_step["loss"], per_step["extra"], per_step["forward"]) == (2, 3, 0)
    scalars = read_scalars(timer.log_dir)
    device = [p for p in ("h2d", "forward", "backward", "optimizer", "loss", "extra") if step_tag(p) in scalars]
    for i, (_, total) in enumerate(scalars[step_tag("step")]):
        assert sum(scalars[step_tag(p)][i][1] for p in device if i < len(scalars[step_tag(p)])) == pytest.approx(total, rel=1e-6)


def test_phase_works_as_a_decorator_and_a_step_can_end_inside_it(tmp_path):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, end_step="manual", summary=False)

    @timer.phase("update")
    def update():
        opt.step()
        timer.end_step()  # the step's end closes the open phase with it

    for i, (x, y) in enumerate(timer.loader):
        nn.functional.mse_loss(model(x), y).backward()
        update()
        if i == 4:
            break
    totals = timer.close()
    assert totals.steps == 5 and totals.phases["update"].count == 5


def test_detach_leaves_model_optimizer_and_scaler_as_they_were(tmp_path):
    model = SleepyNet()
    model.register_forward_hook(lambda *a: None)  # the user's own hook stays
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    before = hook_state(model, [opt], scaler)
    timer = phase_timer.attach(model, opt, loader(), scaler=scaler, log_dir=tmp_path, summary=False)
    assert hook_state(model, [opt], scaler) != before
    timer.detach()
    assert hook_state(model, [opt], scaler) == before
    timer.close()


def test_an_exception_in_the_loop_flushes_and_detaches(tmp_path):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = hook_state(model, [opt])
    with pytest.raises(RuntimeError, match="boom"):
        with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, window=100) as timer:
            for i, (x, y) in enumerate(timer.loader):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if i == 6:
                    model(x)  # half a step, then the failure
                    raise RuntimeError("boom")
    assert hook_state(model, [opt]) == before
    scalars = read_scalars(timer.log_dir)
    assert [s for s, _ in scalars[window_tag("step", "mean")]] == [6]  # 7 whole steps, window flushed
    assert timer.totals.steps == 7
    assert open_files_under(str(tmp_path)) == []


def test_a_user_writer_is_written_and_left_open(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, opt, loader(), writer=writer, warmup_steps=0, window=2, summary=False) as timer:
        train(timer, model, [opt], steps=4)
    writer.add_scalar("user/after_close", 1.0, 10)
    writer.close()
    scalars = read_scalars(str(tmp_path))
    assert [s for s, _ in scalars[window_tag("forward", "mean")]] == [1, 3]
    assert scalars["user/after_close"] == [(10, 1.0)]


def test_environment_switch_attaches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASE_TIMER_DISABLE", "true")
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = loader()
    before = hook_state(model, [opt])
    timer = phase_timer.attach(model, opt, data, log_dir=tmp_path)
    assert timer.loader is data and hook_state(model, [opt]) == before
    assert timer.close().steps == 0  # a disabled timer's results exist, and are empty
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("how", ["env", "argument"])
def test_disabled_timer_still_copies_batches_when_asked(tmp_path, monkeypatch, how):
    # A loop written against copy_to_device=True must keep training when the timer is off.
    if how == "env":
        monkeypatch.setenv("PHASE_TIMER_DISABLE", "1")
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = hook_state(model, [opt])
    timer = phase_timer.attach(
        model, opt, loader(n=32), device="meta", copy_to_device=True, log_dir=tmp_path, enabled=how != "argument"
    )
    batches = list(timer.loader)
    assert len(batches) == 4 and all(t.device.type == "meta" for b in batches for t in b)
    assert hook_state(model, [opt]) == before and timer.core is None
    assert timer.close().steps == 0  # a disabled timer's results exist, and are empty
    assert not list(tmp_path.iterdir())


def _a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    return path


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda t: {"model": "notamodel"}, "model"),
        (lambda t: {"model": []}, "model"),
        (lambda t: {"optimizer": [object()]}, "optimizer"),
        (lambda t: {"optimizer": None}, "optimizer"),
        (lambda t: {"loader": 3}, "loader"),
        (lambda t: {"loader": "data.csv"}, "loader"),
        (lambda t: {"end_step": "epoch"}, "end_step"),
        (lambda t: {"window": 0}, "window"),
        (lambda t: {"window": 2.0}, "window"),
        (lambda t: {"warmup_steps": 1.5}, "warmup_steps"),
        (lambda t: {"max_pending": 0}, "max_pending"),
        (lambda t: {"per_step": "yes"}, "per_step"),
        (lambda t: {"summary": 1}, "summary"),
        (lambda t: {"copy_to_device": "yes"}, "copy_to_device"),
        (lambda t: {"copy_to_device": True, "loader": None}, "copy_to_device"),
        (lambda t: {"enabled": None}, "enabled"),
        (lambda t: {"scaler": 3}, "scaler"),
        (lambda t: {"scaler": torch.amp.GradScaler("cpu"), "end_step": "manual"}, "scaler"),
        (lambda t: {"device": "gpu0"}, "device"),
        (lambda t: {"device": 3.5}, "device"),
        (lambda t: {"device": "cuda:0"} if not torch.cuda.is_available() else {"device": f"cuda:{torch.cuda.device_count()}"}, "device"),
        (lambda t: {"writer": "runs/"}, "writer"),
        (lambda t: {"log_dir": 3}, "log_dir"),
        (lambda t: {"log_dir": _a_file(t)}, "log_dir"),
        (lambda t: {"trace_steps": (5, 5)}, "trace_steps"),
        (lambda t: {"trace_steps": (-1, 3)}, "trace_steps"),
        (lambda t: {"trace_steps": (1, 3), "trace_path": t}, "trace_path"),
        (lambda t: {"rank_timeout_s": 0}, "rank_timeout_s"),
        pytest.param(lambda t: {"nvtx": True}, "nvtx", marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="NVTX works on a CUDA build")),
    ],
)
def test_bad_arguments_name_the_argument(make, name, tmp_path):
    kwargs = {"model": SleepyNet(), "optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), "loader": loader(n=16),
              "log_dir": tmp_path / "logs", **make(tmp_path)}
    with pytest.raises(ValueError, match=rf"attach\({name}=.*`{name}` must be .*got"):
        phase_timer.attach(kwargs.pop("model"), kwargs.pop("optimizer"), kwargs.pop("loader"), **kwargs)
    assert not (tmp_path / "logs").exists()  # raised before anything was made


def test_no_optimizer_with_a_manual_end_is_supported(tmp_path):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with phase_timer.attach(model, None, loader(), log_dir=tmp_path, end_step="manual", warmup_steps=0,
                            summary=False) as timer:
        for i, (x, y) in enumerate(timer.loader):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # not attached: the loop says where its step ends
            timer.end_step()
            if i == 4:
                break
    assert timer.totals.steps == 5 and "optimizer" in timer.totals.phases  # backward's end to the step's end


@pytest.mark.parametrize("name", ["step", "data_wait", "period", "idle", "comm_ms", "comm_wait_ms", "tokens", "not a name", 3])
def test_reserved_or_bad_phase_names_are_refused(name, tmp_path):
    timer = phase_timer.attach(SleepyNet(), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), log_dir=tmp_path,
                               summary=False)
    with pytest.raises(ValueError, match=r"timer.phase\(name="):
        timer.phase(name)
    timer.close()


def test_optimizer_subclass_calling_super_step_counts_as_one_step(tmp_path, host_hours):
    # Hooking any SGD makes PyTorch wrap SGD.step too: a subclass's super().step()
    # then fires the step hooks twice, nested.  The step must still end at the outer one.
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1).register_step_post_hook(lambda *a: None)
    model = SleepyNet()
    opt = SlowSGD(model.parameters(), lr=0.01, sleep_s=0.004)
    with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, summary=False) as timer:
        train(timer, model, [opt], steps=6)
    assert timer.totals.steps == 6
    per_step = hours_per_step(timer.totals)
    assert (per_step["optimizer"], per_step["between_steps"]) == (4, 0)  # the subclass's part of step() is inside


def test_a_loader_iterated_on_a_prefetch_thread_is_named_and_steps_still_timed(tmp_path, host_hours):
    """timer.loader wrapped by a BackgroundGenerator-style thread: its fetches are not the loop's."""
    import queue
    import threading

    def prefetched(iterable, depth=2):
        q: queue.Queue = queue.Queue(depth)

        def fill():
            for item in iterable:
                q.put(item)
            q.put(None)

        threading.Thread(target=fill, daemon=True).start()
        while (item := q.get()) is not None:
            yield item

    model = SleepyNet(forward_s=0.003, backward_s=0.004)
    opt = SlowSGD(model.parameters(), lr=0.01, sleep_s=0.005)
    with pytest.warns(RuntimeWarning, match="iterated on a thread other than the training loop's"):
        with phase_timer.attach(model, opt, loader(n=8 * 12), log_dir=tmp_path, warmup_steps=2, summary=False) as timer:
            for x, y in prefetched(timer.loader):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert timer.totals.steps >= 8
    per_step = hours_per_step(timer.totals)
    assert {p: per_step[p] for p in ("forward", "backward", "optimizer")} == {"forward": 3, "backward": 4, "optimizer": 5}
    assert "data_wait" not in per_step and "h2d" not in per_step  # not the loop's: not timed


def test_two_timers_sharing_a_scaler_detached_first_in_first_out(tmp_path):
    """The first timer's wrapper sits under the second's: it stays, passing through, and drives nothing."""
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    a = phase_timer.attach(model, opt, scaler=scaler, log_dir=tmp_path / "a", summary=False)
    b = phase_timer.attach(model, opt, scaler=scaler, log_dir=tmp_path / "b", summary=False)
    a.close()
    b.close()
    assert a.core is None and b.core is None and a._bounds is None and b._bounds is None
    for _ in range(3):  # training goes on with the scaler as it was
        scaler.scale(nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1))).backward()
        scaler.step(opt)
        scaler.update()
    assert float(scaler.get_scale()) > 0


@pytest.mark.parametrize("case", ["manual, never ended", "optimizer not attached", "loader not iterated", "warm-up"])
def test_never_silent_when_nothing_is_timed(case, tmp_path):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    other = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.01)  # a different optimizer than the one stepped
    kwargs = {"end_step": "manual"} if case == "manual, never ended" else {}
    data = loader(n=8 * 6)
    timer = phase_timer.attach(model, other if case == "optimizer not attached" else opt, data, log_dir=tmp_path,
                               warmup_steps=5 if case == "warm-up" else 1, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = data if case == "loader not iterated" else timer.loader
        for i, (x, y) in enumerate(batches):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if case == "warm-up" and i == 2:
                break
        timer.close()
    ours = [str(w.message) for w in caught if "phase-timer" in str(w.message)]
    assert timer.totals.steps == 0
    reason = timer.last_summary
    if case == "warm-up":  # said in the summary, how to change it included; not a mistake to warn about
        assert "within the warm-up (warmup_steps=5)" in reason and "pass a smaller warmup_steps" in reason and not ours
        return
    assert len(ours) == 1 and "no step was timed" in ours[0], ours
    expected = {"manual, never ended": "call timer.end_step()", "optimizer not attached": "attach the optimizer the loop steps",
                "loader not iterated": "iterate timer.loader"}[case]
    assert expected in ours[0] and "no step was timed" in reason


def test_a_wrapping_optimizer_without_base_optimizer_is_named(tmp_path):
    """An optimizer whose own step() is never called (it steps an inner one it does not expose)."""

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self.inner = torch.optim.SGD(self.param_groups, lr=0.01)

        def apply(self):  # the loop calls this, never step()
            self.inner.step()

    model = SleepyNet()
    wrapper = Wrapper(model.parameters())
    with pytest.warns(RuntimeWarning, match="none ended: the attached optimizers' step\\(\\) never ran"):
        with phase_timer.attach(model, wrapper, loader(n=8 * 6), log_dir=tmp_path, warmup_steps=0, summary=False) as timer:
            for x, y in timer.loader:
                nn.functional.mse_loss(model(x), y).backward()
                wrapper.apply()


def test_a_log_dir_that_cannot_be_made_fails_at_attach_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a log dir under a file cannot be made, whoever runs this
    with pytest.raises(ValueError, match=r"attach\(log_dir=.*`log_dir` must be a directory phase-timer can write"):
        phase_timer.attach(SleepyNet(), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), log_dir=blocker / "runs")


def test_a_full_disk_mid_run_warns_once_and_training_goes_on(tmp_path):
    import errno

    class FullDisk:
        def __init__(self, file, after):
            self.file, self.after = file, after

        def write(self, data):
            self.after -= 1
            if self.after < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, window=2, summary=False)
    event_file = timer.core._sinks[0].sink.sink  # BackgroundSink -> GuardedSink -> EventFileSink
    event_file._file = FullDisk(event_file._file, after=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(timer, model, [opt], steps=20)
        timer.close()
    full = [w for w in caught if "No space left" in str(w.message)]
    assert len(full) == 1 and "training goes on" in str(full[0].message)
    assert timer.totals.steps == 20  # every step timed, the summary complete
    assert open_files_under(str(tmp_path)) == []


def test_the_device_failing_at_the_final_drain_keeps_what_was_resolved(tmp_path):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timer = phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, window=4, summary=False)
    engine = timer.core._engine

    class DyingDevice:  # the engine, whose drain meets a device error (an Xid, an illegal access)
        def __getattr__(self, name):
            return getattr(engine, name)

        def drain(self):
            raise RuntimeError("phase-timer: cuEventSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)")

    timer.core._engine = DyingDevice()
    with pytest.warns(RuntimeWarning, match="could not resolve the last steps.*ILLEGAL_ADDRESS"):
        train(timer, model, [opt], steps=10)
        timer.close()
    assert timer.totals.steps >= 8  # the host clock resolves at once: all but the undrained tail is kept
    assert window_tag("step", "mean") in read_scalars(timer.log_dir)
    assert open_files_under(str(tmp_path)) == []


def test_ctrl_c_in_a_plain_loop_flushes_detaches_and_says_interrupted(tmp_path, capsys):
    model = SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = hook_state(model, [opt])
    original_backward = torch.autograd.backward
    with pytest.raises(KeyboardInterrupt):
        with phase_timer.attach(model, opt, loader(), log_dir=tmp_path, warmup_steps=0, window=100) as timer:
            for i, (x, y) in enumerate(timer.loader):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if i == 6:
                    raise KeyboardInterrupt
    assert hook_state(model, [opt]) == before and torch.autograd.backward is original_backward
    assert "phase-timer (interrupted): 7 steps timed" in timer.last_summary
    assert timer.totals.steps == 7 and [s for s, _ in read_scalars(timer.log_dir)[window_tag("step", "mean")]] == [6]
    assert open_files_under(str(tmp_path)) == []
