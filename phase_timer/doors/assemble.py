"""What every door builds the same way: the clock, the ranks, the outputs and the core of one run.

A door (Lightning, the plain loop, the 🤗 Trainer) says only what is its own: the device,
the window, and where its values go (:class:`Outputs`, made by the door for rank zero).
Everything else -- the clock for the device, the rank exchange, the trace, the run's
context, and the registration that writes the run at interpreter exit or on SIGTERM when
nobody closed it (:mod:`phase_timer.doors.lifecycle`) -- is here, once.

TensorBoard is an output, never a condition of timing: without the ``tensorboard``
package every door still times, prints the table and the verdict and writes the summary
file, and says once which extra writes the TensorBoard values (:func:`own_event_file`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from phase_timer.measures import oom
from phase_timer.measures.snapshot import Snapshot
from phase_timer._env import warn
from phase_timer.timing.clock import make_clock
from phase_timer.config import DEFAULT_LOG_DIR, _fail
from phase_timer.run.core import TimingCore
from phase_timer.doors.options import Options
from phase_timer.distributed.ranks import RankExchange
from phase_timer.runinfo import config_dict, cpu_count, device_name
from phase_timer.outputs.live import LiveFile
from phase_timer.outputs.sinks import BackgroundSink, Outputs, Sink, SummaryWriterSink, next_version_dir, open_event_file
from phase_timer.outputs.user_sinks import with_user_sinks
from phase_timer.measures.flops import check_flops_arg
from phase_timer.measures.step_flops import FlopPlan, MfuNote
from phase_timer.outputs.tags import custom_scalars_layout
from phase_timer.measures.memory import Memory
from phase_timer.measures.syncs import Syncs
from phase_timer.measures.throughput import BatchCounter, RunThroughput
from phase_timer.measures.modules import make as make_modules
from phase_timer.measure import Measure

log = logging.getLogger(__name__)

#: What the run's end says where the TensorBoard values would have gone without the package.
NO_TENSORBOARD = "TensorBoard values not written (the `tensorboard` package is not installed: pip install 'phase-timer[tensorboard]')"


def tensorboard_installed() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def own_event_file(log_dir: str, *, config: Options, ranks: bool, fail_fast: bool) -> Outputs:
    """An event file of our own in ``log_dir`` (and the summary file beside it).

    Without the ``tensorboard`` package: no event file, one warning naming the extra, and the
    summary file still in ``log_dir``.  A directory that cannot be written: a ``ValueError`` naming
    ``log_dir`` (``fail_fast``, before any training), else one warning and the run goes on.
    """
    if not tensorboard_installed():
        warn(log, f"phase-timer: {NO_TENSORBOARD}; the run is timed, and the table, the verdict and "
                  f"{os.path.join(log_dir, 'phase_timer_summary.json')} are written", 3)
        return Outputs(summary_dir=log_dir, missing=NO_TENSORBOARD)
    try:
        sink = open_event_file(log_dir, per_step=config.per_step, ranks=ranks)
    except OSError as err:
        if fail_fast:
            _fail(config.owner, "log_dir", config.log_dir, "a directory phase-timer can write",
                  f" ({type(err).__name__}: {err})")
        warn(log, f"phase-timer: cannot write TensorBoard files nor the summary file in {log_dir} "
                  f"({type(err).__name__}: {err}); timing goes on without them (the table, timer.totals)", 3)
        return Outputs()
    return Outputs([sink], log_dir, log_dir)


def writer_sink(writer: Any, config: Options, *, ranks: bool, name: str) -> Sink:
    """A SummaryWriter that is not ours (the user's, a logger's), written on a thread of its own, with the custom
    scalars' layout; closing the run leaves it open."""
    layout = custom_scalars_layout(config.per_step, ranks)
    return BackgroundSink(SummaryWriterSink(writer, owned=False, layout=layout), name)


def door_outputs(writer: Any, config: Options, user_sinks: Sequence[Any]) -> Callable[[bool], Outputs]:
    """Where the plain door's rank zero values go: the user's SummaryWriter, or an event file of our own in
    ``log_dir`` (default ``phase-timer-logs/version_N``; a directory that cannot be written fails here); and the
    user's sinks beside it."""

    def outputs(ranks: bool) -> Outputs:
        if writer is not None:
            sink = writer_sink(writer, config, ranks=ranks, name="SummaryWriter")
            return Outputs([sink], writer.log_dir, writer.log_dir)
        log_dir = next_version_dir(config.log_dir or DEFAULT_LOG_DIR)
        return own_event_file(log_dir, config=config, ranks=ranks, fail_fast=True)

    return with_user_sinks(outputs, user_sinks, config.owner)


def start_core(
    config: Options,
    device: Any,
    *,
    door: str,
    window: int,
    outputs: Callable[[bool], Outputs] | None,
    trace_dir: str | None = None,
    context: dict[str, Any] | None = None,
    models: Sequence[Any] = (),
) -> TimingCore:
    """The core of one run, with its clock, ranks and (rank zero) outputs.

    ``outputs(distributed)`` is called on rank zero only (None: no files at all).  Under
    torch.distributed every rank times itself and reports to rank zero, which alone writes;
    making the exchange is not a collective: no rank waits here for the others.
    """
    clock = make_clock(device)
    ranks = RankExchange.create()
    rank_zero = ranks is None or ranks.rank == 0
    out = outputs(ranks is not None) if rank_zero and outputs is not None else Outputs()
    core = TimingCore(
        clock, out.sinks, window=window, warmup_steps=config.warmup_steps, max_pending=config.max_pending,
        per_step=config.per_step, nvtx=config.nvtx,
        trace=config.make_trace(out.log_dir or out.summary_dir or trace_dir, clock.kind) if rank_zero else None,
        ranks=ranks,  # the measures, memory's too, are registered below
    )
    # The run's directory for memory_snapshot's file (rank zero's; the others learn it through the store, as they
    # learn where to write their own summary should they run out of memory).
    directory = (out.summary_dir or out.log_dir or trace_dir or os.getcwd()) if rank_zero else None
    for measure in _measures(config, core, device, models, directory):
        core.listen(measure)
    core.summary_dir = out.summary_dir if rank_zero else None
    if core.summary_dir is not None:  # what `phase-timer watch` reads, written on a thread of its own
        core.add_sink(BackgroundSink(LiveFile(core.summary_dir, core.live_view), "live-file"))
    core.log_dir = out.log_dir
    core.outputs_missing = out.missing
    dev = _device(device)
    given = {k: v for k, v in config_dict(config).items() if k != "enabled"}  # every run written had it on
    core.context.update(door=door, config=given, device_type=dev.type if dev is not None else "cpu",
                        device_name=device_name(dev) if dev is not None else "cpu", cpu_count=cpu_count())
    core.context.update(context or {})
    oom.publish(core, directory)
    return core


def _measures(config: Options, core: TimingCore, device: Any, models: Sequence[Any] = (),
              directory: str | None = None) -> list[Measure]:
    """What listens to the run's results, in the order the core calls them: the allocator's history where
    ``memory_snapshot=`` asks (its file in ``directory``; recording starts here, and stops first at the run's end),
    the out-of-memory error that ended the run (the doors' ``oom.caught`` notes it), memory per phase (where the
    device has an allocator to read; the boundaries read it through its tracker), throughput (the boundaries count each batch
    with its counter; rank zero adds the job's rates), then FLOPs and MFU (or the table's note saying how to get
    MFU), then which module (``models``' modules on sampled steps; the boundaries take it from the core), then the
    sync census (the boundaries run it on a warm-up step)."""
    snapshot = Snapshot.start(config.memory_snapshot, core, directory, stacklevel=5)  # warned at the door
    out: list[Measure] = [snapshot] if snapshot is not None else []
    out.append(oom.OutOfMemory(core.ranks))
    memory = Memory.start(core.clock, core.ranks) if config.memory else None
    out += [memory] if memory is not None else []
    out.append(RunThroughput(BatchCounter(config.samples_per_batch, config.tokens_per_batch), core.ranks))
    plan = _flop_plan(config, core.clock.kind, _device(device))
    if plan is not None:
        plan.context = core.context  # the door's precision names the peak
        out.append(plan)
    elif config.mfu:  # the host clock with no peak: said once, with how to get it
        out.append(MfuNote("MFU: not measured on the host clock (no device peak to read FLOPs against): pass "
                           "peak_tflops= (this CPU's dense peak) for MFU, or flops_per_step= as well"))
    mods = make_modules(list(models), config.modules, core.clock, warmup_steps=config.warmup_steps, owner=config.owner,
                        ranks=core.ranks)
    if mods is not None:
        out.append(mods)
    out.append(Syncs())
    return out


def _flop_plan(config: Options, clock: str, device: Any) -> FlopPlan | None:
    """The run's FLOPs and MFU: counted on a device (where a peak can be known), given, or asked for with
    ``peak_tflops=`` (the CPU); None with ``mfu=False``.  Counting on the host clock with no peak would
    cost an untimed step for a figure nobody could read against anything."""
    if not config.mfu or clock == "host" and config.peak_tflops is None and config.flops_per_step is None:
        return None
    name, units = None, None
    if device is not None and device.type == "cuda":
        import torch

        try:  # host-side properties: no sync
            props = torch.cuda.get_device_properties(device)
            name, units = props.name, props.multi_processor_count
        except Exception:  # noqa: BLE001 - no peak from the table then; peak_tflops= still works
            pass
    return FlopPlan(config.owner, given=check_flops_arg(config.owner, config.flops_per_step),
                    peak_tflops=config.peak_tflops, device_name=name, compute_units=units)


def _device(device: Any) -> Any:
    import torch

    try:
        return torch.device(device) if device is not None else None
    except (RuntimeError, TypeError):
        return None
