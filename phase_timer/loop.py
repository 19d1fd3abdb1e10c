"""The plain-PyTorch door: ``attach()`` times a hand-written loop through PyTorch's own hooks.

Where the boundaries sit:

===============  ==================================================================
``data_wait``    host time inside the wrapped loader's ``next()``
step begins      the loader hands over a batch (``h2d`` starts; with
                 ``copy_to_device=True`` the wrapper does the copy, then ``forward``)
``forward``      the model's forward pre-hook (grad enabled, inside a step)
``backward``     the gradient reaching the model's output (a pre-hook on its
                 ``grad_fn``) ... the autograd engine's end-of-pass callback, which
                 may run on another thread
``optimizer``    after backward; the optimizers' step pre-hooks
step ends        the last optimizer's step post-hook (``end_step="optimizer"``),
                 ``scaler.update()`` when a GradScaler is given (so a skipped inf/nan
                 step still ends the step), or ``timer.end_step()`` (``end_step="manual"``)
===============  ==================================================================

A forward with grad disabled between steps is evaluation: not counted, and the
``period`` clock stops until the next training batch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phase_timer.clock import make_clock
from phase_timer.config import TimerConfig, disabled_by_env
from phase_timer.core import TimingCore
from phase_timer.metrics import HOST_PHASES, TOTALS, custom_scalars_layout
from phase_timer.optim_hooks import StepHooks
from phase_timer.ranks import RankExchange
from phase_timer.sinks import BackgroundSink, Sink, SummaryWriterSink, next_version_dir, open_event_file
from phase_timer.stats import RunTotals

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_RESERVED = HOST_PHASES | set(TOTALS) | {"idle"}
_END_STEP = ("optimizer", "manual")


def _to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch to ``device``: pinned, non-blocking."""
    if isinstance(batch, torch.Tensor):
        if batch.device.type == "cpu" and device.type == "cuda" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _first_grad_fn(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for v in values:
        if (fn := _first_grad_fn(v)) is not None:
            return fn
    return None


class _TimedLoader:
    """Iterates the user's loader; times the wait for each batch and opens the step."""

    def __init__(self, timer: LoopTimer, loader: Iterable[Any]) -> None:
        self._timer = timer
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        it = iter(self._loader)
        on_batch = self._timer._on_batch
        while True:
            t0 = time.perf_counter_ns()
            try:
                batch = next(it)
            except StopIteration:
                self._timer._pause()
                return
            yield on_batch(batch, t0)

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class LoopTimer:
    """What :func:`attach` returns: iterate ``timer.loader``, the rest is hooks.

    Use as a context manager (or call :meth:`close`) so the last steps are
    resolved and written even when the loop raises.
    """

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loader: Iterable[Any] | None,
        *,
        config: TimerConfig,
        device: torch.device | str | None,
        copy_to_device: bool,
        writer: SummaryWriter | None,
        end_step: str,
        scaler: Any,
        enabled: bool,
    ) -> None:
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        _check_attach_args(self.models, self.optimizers, end_step, scaler, copy_to_device, enabled)
        self.config = config
        self.enabled = enabled and not disabled_by_env()
        self.device = torch.device(device) if device is not None else self._model_device()
        self._copy = copy_to_device
        self._end_on_optimizer = end_step == "optimizer" and scaler is None
        self._handles: list[Any] = []
        self._scaler, self._scaler_update = scaler, None
        self._explicit: list[str] = []
        self._auto = "h2d"
        self._in_backward = False
        self._step = 0
        self.log_dir: str | None = None
        self.core: TimingCore | None = None
        # Disabled, the wrapper still copies when asked to: the loop relies on it.
        self.loader = _TimedLoader(self, loader) if loader is not None and (self.enabled or copy_to_device) else loader
        if self.enabled:
            clock = make_clock(self.device)
            # Under torch.distributed every rank times itself and reports to rank zero,
            # which alone writes (a collective: every rank attaches at the same point).
            ranks = RankExchange.create()
            self.is_rank_zero = ranks is None or ranks.rank == 0
            sinks = self._make_sinks(writer, ranks is not None) if self.is_rank_zero else []
            self.core = TimingCore(
                clock, sinks, window=config.window or 50,
                warmup_steps=config.warmup_steps, max_pending=config.max_pending, per_step=config.per_step,
                nvtx=config.nvtx, trace=config.make_trace(self.log_dir, clock.kind) if self.is_rank_zero else None,
                ranks=ranks,
            )
            self._install()

    def _model_device(self) -> torch.device:
        for model in self.models:
            for p in model.parameters():
                return p.device
        return torch.device("cpu")

    def _make_sinks(self, writer: SummaryWriter | None, ranks: bool) -> list[Sink]:
        layout = custom_scalars_layout(self.config.per_step, ranks)
        if writer is not None:
            self.log_dir = writer.log_dir
            return [BackgroundSink(SummaryWriterSink(writer, owned=False, layout=layout), "SummaryWriter")]
        self.log_dir = next_version_dir(self.config.log_dir or "phase_timer_logs")
        return [open_event_file(self.log_dir, per_step=self.config.per_step, ranks=ranks)]

    # -- hooks ----------------------------------------------------------------------
    def _install(self) -> None:
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(self._on_forward))
            self._handles.append(model.register_forward_hook(self._on_forward_end))
        self._handles.append(StepHooks(self.optimizers, self._on_optimizer, self._on_optimizer_end))
        if self._scaler is not None:
            self._scaler_update = self._scaler.__dict__.get("update")
            original = self._scaler.update

            def update(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                self.end_step()
                return out

            self._scaler.update = update

    def _set(self, phase: str) -> None:
        """A built-in boundary: switch, unless an explicit phase is open (it wins)."""
        self._auto = phase
        if not self._explicit and self.core is not None:
            self.core.phase(phase)

    def _on_batch(self, batch: Any, t0: int) -> Any:
        core = self.core
        if core is None:
            return _to_device(batch, self.device) if self._copy else batch
        wait_ms = (time.perf_counter_ns() - t0) / 1e6
        core.resume()
        if core.in_step:  # another micro-batch: the span since the last backward was the device idling
            core.relabel("idle")
            self._set("h2d")
        else:
            self._auto = "h2d"
            core.begin_step(self._step, "h2d")
        core.add_host("data_wait", wait_ms)
        if self._copy:
            batch = _to_device(batch, self.device)
            self._set("forward")
        return batch

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        core = self.core
        if core is None:
            return
        if not torch.is_grad_enabled():
            if not core.in_step:
                core.pause()  # evaluation between steps: not part of any step's period
            return
        if not core.in_step and self.loader is None:
            core.begin_step(self._step, "forward")
        self._set("forward")

    def _on_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.core is None or not self.core.in_step or not torch.is_grad_enabled():
            return
        grad_fn = _first_grad_fn(output)
        if grad_fn is not None:
            grad_fn.register_prehook(self._on_backward_start)

    def _on_backward_start(self, grad_outputs: Any) -> None:
        if not self._in_backward and self.core is not None and self.core.in_step:
            self._in_backward = True
            self._set("backward")
            # The engine runs this when the whole pass is done, on whichever thread
            # finished it, with the caller's streams current.
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward_callbacks)
        return None

    def _after_backward_callbacks(self) -> None:
        # DDP and FSDP queue their own end-of-backward callbacks (waiting for the last
        # all-reduce / reduce-scatter) after ours; a callback queued from a callback
        # runs after all of them, so backward includes what it could not overlap.
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._in_backward = False
        self._set("optimizer")

    def _on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self._set("optimizer")

    def _on_optimizer_end(self, opt: torch.optim.Optimizer) -> None:
        if self._end_on_optimizer and opt is self.optimizers[-1]:
            self.end_step()

    # -- public ---------------------------------------------------------------------
    def end_step(self) -> None:
        """End the running step (automatic at the optimizer step unless ``end_step="manual"``)."""
        core = self.core
        if core is None or not core.in_step:
            return
        core.end_step()
        self._step += 1
        self._auto = "h2d"

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        self._explicit.append(name)
        if self.core is not None:
            self.core.phase(name)
        try:
            yield
        finally:
            self._explicit.pop()
            if self.core is not None:  # back to the enclosing phase
                self.core.phase(self._explicit[-1] if self._explicit else self._auto)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a named region: ``with timer.phase("clip"): ...`` or ``@timer.phase("ema")``.

        The innermost open phase owns the time (nesting is exclusive, so phases still
        add up to the step); built-in boundaries inside it are deferred until it closes.
        Outside a step nothing is recorded.
        """
        if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
            raise ValueError(
                f"timer.phase(name={name!r}): `name` must be an identifier other than "
                f"{sorted(_RESERVED)}, got {name!r}"
            )
        return _PhaseContext(self, name)

    def _pause(self) -> None:
        if self.core is not None:
            self.core.pause()

    def detach(self) -> None:
        """Remove every hook: the model, optimizers and scaler are left as they were."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._scaler is not None:
            if self._scaler_update is None:
                self._scaler.__dict__.pop("update", None)
            else:
                self._scaler.update = self._scaler_update
            self._scaler = None

    def close(self, *, interrupted: bool = False) -> RunTotals | None:
        """Detach, resolve what is pending (the one wait for the device), write, print the summary.

        ``interrupted`` (set when the ``with`` block raises): under torch.distributed,
        send no last report and wait for no other rank.
        """
        self.detach()
        core, self.core = self.core, None
        if core is None:
            return self.totals
        self.totals = core.finish(rank_timeout_s=self.config.rank_timeout_s, interrupted=interrupted)
        self.last_summary = core.summary_table()
        if self.config.summary and self.is_rank_zero:
            print(self.last_summary, flush=True)
        return self.totals

    totals: RunTotals | None = None
    last_summary: str | None = None
    is_rank_zero: bool = True

    def __enter__(self) -> LoopTimer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # Leaving by an exception: under torch.distributed, wait for no other rank.
        self.close(interrupted=exc_type is not None)


class _PhaseContext(contextlib.ContextDecorator):
    def __init__(self, timer: LoopTimer, name: str) -> None:
        self._timer, self._name = timer, name
        self._cm: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        self._cm = self._timer._phase(self._name)
        self._cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        assert self._cm is not None
        return self._cm.__exit__(*exc)


def _check_attach_args(models: list[Any], optimizers: list[Any], end_step: Any, scaler: Any, copy: Any, enabled: Any) -> None:
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise ValueError(f"attach(model={models!r}): `model` must be an nn.Module or a list of them, got {models!r}")
    if not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError(
            f"attach(optimizer={optimizers!r}): `optimizer` must be a torch.optim.Optimizer or a list of them, "
            f"got {optimizers!r}"
        )
    if end_step not in _END_STEP:
        raise ValueError(f"attach(end_step={end_step!r}): `end_step` must be one of {_END_STEP}, got {end_step!r}")
    if end_step == "optimizer" and not optimizers and scaler is None:
        raise ValueError("attach(end_step='optimizer'): no optimizer given; pass one, or end_step='manual'")
    if scaler is not None and not callable(getattr(scaler, "update", None)):
        raise ValueError(f"attach(scaler={scaler!r}): `scaler` must be a torch.amp.GradScaler, got {scaler!r}")
    for name, value in (("copy_to_device", copy), ("enabled", enabled)):
        if not isinstance(value, bool):
            raise ValueError(f"attach({name}={value!r}): `{name}` must be True or False, got {value!r}")


def attach(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    loader: Iterable[Any] | None = None,
    *,
    device: torch.device | str | None = None,
    copy_to_device: bool = False,
    writer: SummaryWriter | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    window: int = 50,
    warmup_steps: int = 5,
    max_pending: int = 64,
    per_step: bool = False,
    summary: bool = True,
    end_step: str = "optimizer",
    scaler: Any = None,
    nvtx: bool = False,
    trace_steps: tuple[int, int] | None = None,
    trace_path: str | os.PathLike[str] | None = None,
    rank_timeout_s: float = 30.0,
    enabled: bool = True,
) -> LoopTimer:
    """Attach phase-timer to a hand-written loop; iterate ``timer.loader`` instead of the loader.

    Args:
        model: the module(s) the loop calls for the training forward.
        optimizer: the optimizer(s); the step ends after the last one's ``step()``.
        loader: the training data loader (any iterable of batches).
        device: the device the work runs on (default: the model's).
        copy_to_device: the wrapper copies each batch to ``device`` (pinned, non-blocking).
        writer / log_dir: a SummaryWriter to write into, or a directory for our own
            (default ``phase_timer_logs/version_N``).
        window, warmup_steps, max_pending, per_step, summary: as for ``PhaseTimer``.
        end_step: ``"optimizer"`` or ``"manual"`` (call ``timer.end_step()``).
        scaler: a GradScaler: the step then ends at ``scaler.update()``, skipped steps included.
        nvtx: also push each phase as an NVTX range (Nsight Systems); off by default.
        trace_steps, trace_path: write a Chrome/Perfetto trace of steps ``first..stop-1``
            on the device's timeline (default ``<log_dir>/phase_trace.json``), on close.
        rank_timeout_s: under torch.distributed, how long ``close()`` waits for the other
            ranks' last reports (not at all when the ``with`` block raised).
        enabled: ``False`` (or ``PHASE_TIMER_DISABLE=1``) attaches nothing.  Under
            torch.distributed it must be the same on every rank (attaching creates a
            process group, a collective); only rank zero writes anyway.
    """
    config = TimerConfig(
        window=window, warmup_steps=warmup_steps, max_pending=max_pending, per_step=per_step,
        summary=summary, log_dir=log_dir, nvtx=nvtx, trace_steps=trace_steps, trace_path=trace_path,
        rank_timeout_s=rank_timeout_s, owner="attach",
    )
    return LoopTimer(
        model, optimizer, loader, config=config, device=device, copy_to_device=copy_to_device,
        writer=writer, end_step=end_step, scaler=scaler, enabled=enabled,
    )
