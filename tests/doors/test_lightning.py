"""The callback in real Trainers on the CPU, read back from real TensorBoard files."""

from __future__ import annotations

import importlib
import os
import signal
import warnings

import pytest

from phase_timer import PhaseTimer
from phase_timer.outputs.tags import window_tag
from tests import helpers
from tests.helpers import (
    NAMESPACES, event_files, hours, hours_per_step, loader, module_class, open_files_under, read_scalars, trainer,
)

pytestmark = pytest.mark.timeout(300)
STATS = ("mean", "p50", "p90", "max")
DEVICE_PHASES = ("h2d", "forward", "backward", "optimizer")


def steps_of(scalars, phase="step", stat="mean"):
    return [s for s, _ in scalars[window_tag(phase, stat)]]


def values_of(scalars, phase, stat="mean"):
    return [v for _, v in scalars[window_tag(phase, stat)]]


def assert_increasing_unique(steps):
    assert steps == sorted(set(steps)), steps


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_phase_logged_at_lightnings_steps(ns, tmp_path, capsys):
    timer = PhaseTimer(warmup_steps=2)
    t = trainer(ns, str(tmp_path), [timer], max_steps=30, log_every_n_steps=5)
    t.fit(module_class(ns)(), loader())
    scalars = read_scalars(t.logger.log_dir)
    for phase in ("data_wait", *DEVICE_PHASES, "step", "period"):
        for stat in STATS:
            assert window_tag(phase, stat) in scalars, (phase, stat)
            assert steps_of(scalars, phase, stat) == [4, 9, 14, 19, 24, 29]  # one value per window
    assert [s for s, _ in scalars["train_loss"]] == steps_of(scalars)  # the same x-axis as Lightning's own
    for phase in DEVICE_PHASES:
        for lo, hi in (("p50", "p90"), ("p90", "max"), ("mean", "max")):
            assert all(a <= b + 1e-9 for a, b in zip(values_of(scalars, phase, lo), values_of(scalars, phase, hi)))
    # device phases add up to the step (window means of a sum are sums of window means)
    for i, step_mean in enumerate(values_of(scalars, "step")):
        assert sum(values_of(scalars, p)[i] for p in DEVICE_PHASES) == pytest.approx(step_mean, rel=1e-4)
    assert "batch_to_device" not in t.strategy.__dict__  # the wrapper is gone
    assert "_broadcast_sigterm_tensor" not in t.fit_loop.epoch_loop.__dict__
    assert "sync_wait" not in timer.totals.phases  # one process: Lightning broadcasts nothing
    assert "forward" in capsys.readouterr().out  # the summary table was printed
    assert timer.totals.steps == 28


def test_custom_scalars_layout_in_the_loggers_run_dir(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    t = trainer("lightning.pytorch", str(tmp_path), [PhaseTimer(warmup_steps=0)], max_steps=6, log_every_n_steps=2)
    t.fit(module_class("lightning.pytorch")(), loader())
    acc = EventAccumulator(t.logger.log_dir)
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["mean per phase (ms)"] == [r"^phase_time/.*_ms/mean$"]
    assert len(event_files(t.logger.log_dir)) == 1  # same run directory as the logger


def test_phases_are_attributed_where_the_time_is_spent(tmp_path, host_hours):
    ns = "lightning.pytorch"
    model = module_class(ns)(h2d=0.004, forward=0.006, backward=0.008, optimizer=0.010)
    timer = PhaseTimer(warmup_steps=2)
    t = trainer(ns, str(tmp_path), [timer], max_steps=14, log_every_n_steps=4)
    t.fit(model, loader(sleep_s=0.0005))
    # Every step: its planted hours where they were planted (8 items of 0.5 in the fetch), and nowhere else.
    assert hours_per_step(timer.totals) == {"data_wait": 4, "h2d": 4, "forward": 6, "backward": 8, "optimizer": 10,
                                            "between_steps": 0, "step": 28, "period": 32}


@pytest.mark.parametrize("ns", NAMESPACES)
def test_gradient_accumulation_one_record_per_optimizer_step(ns, tmp_path, host_hours):
    model = module_class(ns)(forward=0.003, backward=0.002)
    timer = PhaseTimer(warmup_steps=1, per_step=True)
    t = trainer(ns, str(tmp_path), [timer], max_steps=8, log_every_n_steps=2, accumulate_grad_batches=4)
    t.fit(model, loader())
    scalars = read_scalars(t.logger.log_dir)
    per_step = [s for s, _ in scalars["phase_time_step/step_ms"]]
    assert per_step == list(range(1, 8))  # optimizer steps 1..7, at Lightning's step index
    assert steps_of(scalars) == [s for s, _ in scalars["train_loss"]][-len(steps_of(scalars)):]
    fwd = [v for _, v in scalars["phase_time_step/forward_ms"]]
    bwd = [v for _, v in scalars["phase_time_step/backward_ms"]]
    assert {hours(v) for v in fwd} == {4 * 3} and {hours(v) for v in bwd} == {4 * 2}  # four micro-batches summed
    assert "phase_time_step/idle_ms" in scalars  # the device between micro-batches
    dw = timer.totals.phases["data_wait"]
    assert dw.count == 7


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("manual", [0, 2])
def test_the_optimizer_step_count_it_reads_is_global_step(ns, tmp_path, manual):
    # The timer reads Lightning's own count of optimizer steps in one attribute, not through global_step's
    # six properties: through a fit (accumulation, manual optimization) it says what global_step says.
    pl = importlib.import_module(ns)
    seen = []

    class Check(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append((timer._optimizer_steps(trainer), trainer.global_step, timer._steps_total is not None))

        def on_train_batch_end(self, trainer, *args):
            seen.append((timer._optimizer_steps(trainer), trainer.global_step, timer._steps_total is not None))

    timer = PhaseTimer(warmup_steps=1)
    kw = {} if manual else {"accumulate_grad_batches": 2}
    t = trainer(ns, str(tmp_path), [timer, Check()], max_steps=6 * (manual or 1), log_every_n_steps=2, **kw)
    t.fit(module_class(ns)(manual=manual), loader())
    assert len(seen) >= 12 and all(ours == theirs and fast for ours, theirs, fast in seen), seen
    assert seen[-1][1] == 6 * (manual or 1)
    assert timer._steps_total is None  # not kept past the fit


@pytest.mark.parametrize("n_opt", [1, 2])
def test_manual_optimization_with_one_or_several_optimizers(tmp_path, n_opt, host_hours):
    ns = "lightning.pytorch"
    model = module_class(ns)(manual=n_opt, forward=0.003, optimizer=0.005, backward=0.002)
    timer = PhaseTimer(warmup_steps=1)
    t = trainer(ns, str(tmp_path), [timer], max_steps=8 * n_opt, log_every_n_steps=2)
    t.fit(model, loader())
    per_step = hours_per_step(timer.totals)
    assert {p: per_step[p] for p in ("forward", "backward", "optimizer", "between_steps")} == {
        "forward": 3 * n_opt, "backward": 2 * n_opt, "optimizer": 5 * n_opt, "between_steps": 0}
    assert timer.totals.steps == 7  # one record per batch, whatever the number of optimizers
    scalars = read_scalars(t.logger.log_dir)
    assert_increasing_unique(steps_of(scalars))
    assert all(opt._optimizer_step_pre_hooks == {} for opt in t.optimizers)  # hooks removed


def test_validation_and_sanity_check_are_not_counted(tmp_path, host_hours):
    ns = "lightning.pytorch"
    model = module_class(ns)(val=0.03)
    timer = PhaseTimer(warmup_steps=1)
    t = trainer(
        ns, str(tmp_path), [timer], max_steps=20, log_every_n_steps=5, val_check_interval=5,
        limit_val_batches=4, num_sanity_val_steps=2,
    )
    t.fit(model, loader(), loader())
    totals = timer.totals.phases
    assert totals["h2d"].count == 19  # the validation batches' copies are not in
    # validation (4 batches of 30 planted hours) after steps 5, 10, 15 and 20 (the last), and the sanity check's
    # 2 batches before the first step: all ran, and in no phase and no period
    assert hours(host_hours.offset_ns / 1e6) == 30 * (2 + 4 * 4) and set(hours_per_step(timer.totals).values()) == {0}


def test_bf16_mixed_and_gradient_clipping(tmp_path, host_hours):
    ns = "lightning.pytorch"
    timer = PhaseTimer(warmup_steps=1)
    t = trainer(ns, str(tmp_path), [timer], max_steps=10, log_every_n_steps=3, precision="bf16-mixed",
                gradient_clip_val=0.5)
    t.fit(module_class(ns)(optimizer=0.002), loader())
    scalars = read_scalars(t.logger.log_dir)
    assert steps_of(scalars) == [2, 5, 8, 9]
    assert hours_per_step(timer.totals)["optimizer"] == 2


def _assert_closed_and_flushed(t, timer, tmp_path, expect_steps):
    assert "batch_to_device" not in t.strategy.__dict__
    assert timer.core is None
    assert open_files_under(str(tmp_path)) == []
    scalars = read_scalars(timer.log_dir)
    assert steps_of(scalars)[-1] == expect_steps  # the last, partial window made it to disk
    assert "interrupted" in timer.last_summary


def test_exception_mid_run_flushes_restores_and_closes(tmp_path):
    ns = "lightning.pytorch"
    timer = PhaseTimer(warmup_steps=1, log_dir=tmp_path / "pt")
    t = trainer(ns, str(tmp_path), [timer], max_steps=40, log_every_n_steps=5, logger=False)
    with pytest.raises(RuntimeError, match="planted"):
        t.fit(module_class(ns)(fail_at=12), loader())
    _assert_closed_and_flushed(t, timer, tmp_path, expect_steps=11)


def test_keyboard_interrupt_flushes_restores_and_closes(tmp_path):
    ns = "lightning.pytorch"
    timer = PhaseTimer(warmup_steps=1, log_dir=tmp_path / "pt")
    t = trainer(ns, str(tmp_path), [timer], max_steps=40, log_every_n_steps=5, logger=False)
    try:
        with pytest.raises(SystemExit):  # Lightning turns Ctrl+C into a graceful exit(1)
            t.fit(module_class(ns)(fail_at=12, fail_with=KeyboardInterrupt), loader())
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _assert_closed_and_flushed(t, timer, tmp_path, expect_steps=11)


def test_without_a_logger_it_writes_only_where_log_dir_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    timer = PhaseTimer(warmup_steps=0, summary=False)
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=6, log_every_n_steps=3, logger=False)
    t.fit(module_class("lightning.pytorch")(), loader())
    assert os.listdir(tmp_path) == [] and timer.log_dir is None and timer.summary_path is None
    assert timer.totals.steps == 6 and timer.diagnosis is not None  # the numbers, in code
    timer = PhaseTimer(warmup_steps=0, log_dir=tmp_path / "pt")
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=6, log_every_n_steps=3, logger=False)
    t.fit(module_class("lightning.pytorch")(), loader())
    assert timer.log_dir == str(tmp_path / "pt") and os.listdir(tmp_path) == ["pt"]
    assert steps_of(read_scalars(timer.log_dir)) == [2, 5]
    assert os.path.dirname(timer.summary_path) == timer.log_dir
    assert open_files_under(str(tmp_path)) == []


def test_fit_twice_with_the_same_callback(tmp_path):
    ns = "lightning.pytorch"
    timer = PhaseTimer(warmup_steps=1)
    for run in ("a", "b"):
        t = trainer(ns, str(tmp_path / run), [timer], max_steps=10, log_every_n_steps=5)
        t.fit(module_class(ns)(), loader())
        assert steps_of(read_scalars(t.logger.log_dir)) == [4, 9]
        assert "batch_to_device" not in t.strategy.__dict__
    assert timer.totals.steps == 9  # the second fit started afresh


# What this test does on purpose, and Lightning says so: a checkpoint taken mid-epoch, resumed with a new Trainer.
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_from_checkpoint_continues_steps_without_duplicates(tmp_path):
    ns = "lightning.pytorch"
    pl = importlib.import_module(ns)
    model_cls = module_class(ns)
    logger = lambda: pl.loggers.TensorBoardLogger(str(tmp_path), name="logs", version=0)  # noqa: E731
    t1 = trainer(ns, str(tmp_path), [PhaseTimer(warmup_steps=1)], max_steps=20, log_every_n_steps=5,
                 logger=logger(), enable_checkpointing=True)
    t1.fit(model_cls(), loader(n=8 * 40))
    ckpt = t1.checkpoint_callback.best_model_path or t1.checkpoint_callback.last_model_path
    assert os.path.exists(ckpt)
    t2 = trainer(ns, str(tmp_path), [PhaseTimer(warmup_steps=1)], max_steps=40, log_every_n_steps=5, logger=logger())
    t2.fit(model_cls(), loader(n=8 * 40), ckpt_path=ckpt)
    steps = steps_of(read_scalars(t2.logger.log_dir))
    assert steps == [4, 9, 14, 19, 24, 29, 34, 39]


def test_environment_switch_makes_it_a_no_op(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASE_TIMER_DISABLE", "1")
    timer = PhaseTimer()
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=8, log_every_n_steps=2)
    t.fit(module_class("lightning.pytorch")(), loader())
    assert not any(tag.startswith("phase_time") for tag in read_scalars(t.logger.log_dir))
    assert timer.totals.steps == 0 and not timer.totals.phases  # a disabled timer's results exist, and are empty


def test_a_failing_logger_warns_once_and_training_goes_on(tmp_path):
    pl = importlib.import_module("lightning.pytorch")

    class Broken(pl.loggers.CSVLogger):
        def log_metrics(self, metrics, step=None):
            if any(k.startswith("phase_time") for k in metrics):
                raise ConnectionError("logging service unreachable")
            super().log_metrics(metrics, step)

    timer = PhaseTimer(warmup_steps=0)
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=20, log_every_n_steps=2,
                logger=[Broken(str(tmp_path)), pl.loggers.TensorBoardLogger(str(tmp_path), name="tb")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module_class("lightning.pytorch")(), loader())
    assert len([w for w in caught if "unreachable" in str(w.message)]) == 1
    assert t.global_step == 20
    assert steps_of(read_scalars(t.loggers[1].log_dir)) == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"max_pending": "8"}, "max_pending"),
        ({"per_step": 1}, "per_step"),
        ({"summary": None}, "summary"),
        ({"log_dir": 3}, "log_dir"),
        ({"log_dir": __file__}, "log_dir"),
        ({"enabled": "yes"}, "enabled"),
        ({"trace_steps": (2, 1)}, "trace_steps"),
        ({"trace_steps": (1, 3), "trace_path": os.path.dirname(__file__)}, "trace_path"),
        ({"rank_timeout_s": float("inf")}, "rank_timeout_s"),
        pytest.param({"nvtx": True}, "nvtx", marks=pytest.mark.skipif(
            importlib.import_module("torch").cuda.is_available(), reason="NVTX works on a CUDA build")),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"PhaseTimer\({name}=.*`{name}` must be .*got"):
        PhaseTimer(**kwargs)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        PhaseTimer(10)  # type: ignore[misc]


@pytest.mark.parametrize("place", ["before", "after"])
def test_a_busy_callback_is_named_between_steps_not_optimizer(tmp_path, place, host_hours):
    """Issue 17: host work in another callback's on_train_batch_end, listed before or after PhaseTimer."""
    pl = importlib.import_module("lightning.pytorch")

    class Busy(pl.Callback):
        def on_train_batch_end(self, *args):
            helpers.pause(0.02)

    timer = PhaseTimer(warmup_steps=2)
    callbacks = [Busy(), timer] if place == "before" else [timer, Busy()]
    t = trainer("lightning.pytorch", str(tmp_path), callbacks, max_steps=10, log_every_n_steps=5, logger=False)
    t.fit(module_class("lightning.pytorch")(optimizer=0.002), loader())
    per_step = hours_per_step(timer.totals)
    assert per_step["between_steps"] == 20
    assert (per_step["optimizer"], per_step["data_wait"]) == (2, 0)  # neither holds the callback's 20
    assert "between_steps: " in timer.last_summary and "% of period" in timer.last_summary


def test_two_phase_timers_in_one_trainer_leave_it_working(tmp_path):
    """Both time the run; their patches are undone or left passing through, and a second fit works."""
    ns = "lightning.pytorch"
    a, b = PhaseTimer(warmup_steps=1, summary=False), PhaseTimer(warmup_steps=1, summary=False)
    t = trainer(ns, str(tmp_path), [a, b], max_steps=6, log_every_n_steps=3, logger=False)
    t.fit(module_class(ns)(), loader())
    assert a.totals.steps == b.totals.steps == 5
    assert a.core is None and b.core is None
    t2 = trainer(ns, str(tmp_path / "again"), [PhaseTimer(warmup_steps=1, summary=False)], max_steps=4,
                 log_every_n_steps=2, logger=False)
    t2.fit(module_class(ns)(), loader())


# The flavor under test is experimental, and Lightning says so twice.
@pytest.mark.filterwarnings("ignore:You are using the `dataloader_iter` step flavor")
@pytest.mark.filterwarnings("ignore:Found `dataloader_iter` argument in the `training_step`")
def test_a_dataloader_iter_training_step_is_timed(tmp_path, host_hours):
    """training_step(self, dataloader_iter): no batch_to_device; the step begins with forward."""
    import torch
    from torch import nn

    pl = importlib.import_module("lightning.pytorch")

    class IterModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(16, 1)

        def training_step(self, dataloader_iter):
            (x, y), _, _ = next(dataloader_iter)
            seen.append(timer.core.context.get("fetch_in_step") is True)
            helpers.pause(0.004)
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    seen: list[bool] = []
    timer = PhaseTimer(warmup_steps=1)
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=8, log_every_n_steps=4, logger=False)
    t.fit(IterModule(), loader(sleep_s=0.001))
    per_step = hours_per_step(timer.totals)
    assert timer.totals.steps == 7 and "h2d" not in per_step
    assert per_step["data_wait"] == 8  # 8 items of 1, fetched inside the step
    assert per_step["forward"] == 8 + 4  # on the device (here the host) the fetch is inside forward
    # so its device's idle over the fetch is in forward, not before the step: the verdict takes the whole wait
    assert seen and all(seen)


def test_fast_dev_run_says_why_nothing_was_timed(tmp_path):
    timer = PhaseTimer()
    t = trainer("lightning.pytorch", str(tmp_path), [timer], fast_dev_run=True, logger=False)
    t.fit(module_class("lightning.pytorch")(), loader())
    assert "within the warm-up (warmup_steps=5)" in timer.last_summary
    assert "pass a smaller warmup_steps" in timer.last_summary


def test_fast_dev_run_writes_only_where_log_dir_says(tmp_path, monkeypatch):
    """Under fast_dev_run Lightning swaps the loggers for a DummyLogger: ``log_dir=`` still gets the files."""
    monkeypatch.chdir(tmp_path)
    timer = PhaseTimer(warmup_steps=0, log_every_n_steps=2, summary=False, log_dir=tmp_path / "pt")
    t = trainer("lightning.pytorch", str(tmp_path), [timer], fast_dev_run=4)  # with a TensorBoardLogger
    t.fit(module_class("lightning.pytorch")(), loader())
    assert os.listdir(tmp_path) == ["pt"] and timer.log_dir == str(tmp_path / "pt")
    assert steps_of(read_scalars(timer.log_dir)) == [1, 3]
    assert os.path.dirname(timer.summary_path) == timer.log_dir


def test_sigterm_flushes_restores_and_closes(tmp_path):
    """Lightning turns SIGTERM into SIGTERMException at the batch's end: as Ctrl+C, the run's timing is kept."""
    ns = "lightning.pytorch"
    pl = importlib.import_module(ns)

    class Terminate(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 12:
                os.kill(os.getpid(), signal.SIGTERM)  # what a cluster scheduler sends

    timer = PhaseTimer(warmup_steps=1, log_dir=tmp_path / "pt")
    t = trainer(ns, str(tmp_path), [timer, Terminate()], max_steps=40, log_every_n_steps=5, logger=False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            t.fit(module_class(ns)(), loader())
    finally:
        signal.signal(signal.SIGTERM, previous)
    _assert_closed_and_flushed(t, timer, tmp_path, expect_steps=11)


def test_an_unwritable_log_dir_warns_and_timing_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    timer = PhaseTimer(warmup_steps=1, log_dir=blocker / "runs")  # cannot be made: found out at fit
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=6, log_every_n_steps=3, logger=False)
    with pytest.warns(RuntimeWarning) as said:
        t.fit(module_class("lightning.pytorch")(), loader())
    assert timer.totals.steps == 5 and "forward" in timer.last_summary
    ours = [str(w.message) for w in said if str(w.message).startswith("phase-timer")]
    assert len(ours) == 1, ours  # once: the directory (neither its TensorBoard files nor the summary is tried again)
    assert "cannot write TensorBoard files nor the summary file" in ours[0] and "timing goes on" in ours[0]
    assert timer.summary_path is None


def test_a_subclass_of_the_callback_is_a_callback_and_pickles(tmp_path):
    """Users subclass callbacks; spawn strategies pickle them: both work with the class made at construction."""
    import pickle

    import lightning.pytorch as pl

    class Mine(PhaseTimer):
        def on_fit_start(self, trainer, pl_module):
            self.started = True

    timer = Mine(warmup_steps=0, summary=False)
    assert isinstance(timer, pl.Callback) and isinstance(timer, Mine) and type(timer).__name__ == "Mine"
    t = trainer("lightning.pytorch", str(tmp_path), [timer], max_steps=4, log_every_n_steps=2, logger=False)
    t.fit(module_class("lightning.pytorch")(), loader())
    assert timer.started and timer.totals.steps == 4
    again = pickle.loads(pickle.dumps(PhaseTimer(warmup_steps=3)))
    assert isinstance(again, pl.Callback) and again.config.warmup_steps == 3
