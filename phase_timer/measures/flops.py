"""FLOPs of a training step per phase: counted once per batch shape, or given by the user.

A door counts on one untimed warm-up step: :meth:`FlopCounter.start` at the step's first
boundary, :meth:`FlopCounter.mark` at each phase's begin, :meth:`FlopCounter.stop` at the
step's end.  Between them ``torch.utils.flop_counter.FlopCounterMode`` runs (a Python
dispatch for every op: the step is slower, so it is not timed) and its running total is read
at each boundary.  Everything here reads shapes, never values: no host-device sync.

What FlopCounterMode sees (``docs/flops.md``, with the figures): the matmuls and convolutions
(``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``, convolutions) and the attention
kernels of CUDA's SDPA (flash, memory-efficient, cuDNN, counted in full even when causal);
not element-wise work (LayerNorm, GELU, softmax, the optimizer: 0, as MFU wants), not the CPU's
fused SDPA kernel, not custom ops or Triton kernels it has no formula for (Transformer Engine,
Liger, bitsandbytes).  Recompute (activation checkpointing, and SDPA's backward, whose formula
counts its recompute of the scores) is counted where it runs: ``backward``.

torch.compile: under a dispatch mode Dynamo runs the frame eagerly, and (up to torch 2.13 at
least, pytorch/pytorch#140909 and #190286) marks its code to be skipped *for good*: one counted
step would leave the model uncompiled for the rest of the run.  So the counted step runs under
``torch.compiler.set_stance("force_eager")``, which never reaches that code: the eager ops are
counted (the compiled graph does the same matmuls) and compiled code runs again after.  A torch
without ``set_stance`` (< 2.6) cannot count safely once anything is compiled: it does not count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from phase_timer._env import warn_once
from phase_timer.config import check_flops, check_peak
from phase_timer.phases import BACKWARD, FORWARD

log = logging.getLogger(__name__)

COUNTED, GIVEN = "counted", "given"
#: Distinct batch shapes counted at most; after that a new shape is not counted (each count costs an
#: untimed step, so a loader whose every batch has its own length must not count every step).
MAX_SHAPES = 8
#: torch.compile(module) warns that ModuleTracker's global hooks (FlopCounterMode's) fire twice: harmless here.
_GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


@dataclass(frozen=True)
class StepFlops:
    """One step's FLOPs by phase, as counted by FlopCounterMode or given by the user.

    Attributes:
        phases: FLOPs per phase (``forward``, ``backward``; any phase a door marked).  Empty when the
            user gave a total only.
        source: ``counted`` (FlopCounterMode) or ``given`` (``flops_per_step=``).
        given_total: the user's total, when it was given as one number.
    """

    phases: dict[str, float]
    source: str
    given_total: float | None = None
    #: FLOPs by the dtype of the matmuls' inputs (``torch.bfloat16`` ...), as counted: the precision the
    #: device's peak is read for (autocast's dtype is what the kernels see).  Empty when given.
    dtypes: dict[Any, float] = dataclasses.field(default_factory=dict)

    @property
    def dtype(self) -> Any:
        """The dtype most of the step's FLOPs ran in (None: not counted)."""
        return max(self.dtypes, key=self.dtypes.__getitem__) if self.dtypes else None

    @property
    def forward(self) -> float | None:
        return self.phases.get(FORWARD)

    @property
    def backward(self) -> float | None:
        return self.phases.get(BACKWARD)

    @property
    def recompute(self) -> float:
        """FLOPs backward ran beyond twice the forward's: recompute.  A backward does at most two matmuls
        of each forward one (the inputs' gradient and the weights'); more is activation checkpointing's
        recompute or SDPA's backward recomputing its scores (FlopCounterMode counts both)."""
        fwd, bwd = self.forward, self.backward
        if fwd is None or bwd is None:
            return 0.0
        return max(0.0, bwd - 2.0 * fwd)

    @property
    def hardware_total(self) -> float:
        """Everything the device ran, recompute included."""
        return self.given_total if self.given_total is not None else float(sum(self.phases.values()))

    @property
    def model_total(self) -> float:
        """The model's FLOPs, recompute left out: MFU's numerator, as torchtitan and PaLM define it."""
        return self.hardware_total - self.recompute


def check_flops_arg(owner: str, value: Any, name: str = "flops_per_step") -> StepFlops | None:
    """``flops_per_step=`` checked (``config.check_flops``: fails fast naming the argument), as the count to use."""
    check_flops(owner, name, value)
    if value is None:
        return None
    if isinstance(value, Mapping):
        return StepFlops({k: float(v) for k, v in value.items()}, GIVEN)
    return StepFlops({}, GIVEN, given_total=float(value))


def check_peak_arg(owner: str, value: Any, name: str = "peak_tflops") -> float | None:
    """``peak_tflops=`` checked (``config.check_peak``), as TFLOP/s (None: the table's)."""
    check_peak(owner, name, value)
    return None if value is None else float(value)


class FlopCounter:
    """One run's FLOP counts: one per batch signature, counted on a step the door chooses.

    A door, at a step's first boundary (before the forward), with ``sig = signature(batch)`` (``phase_timer.signature``)::

        flops = counter.known(sig)              # the count for this shape, or the given one, or None
        if counter.wants(sig) and <this step may go untimed>:
            counter.start(sig, "forward")       # FLOPs from now are forward's
        ...
        counter.mark("backward")                # at backward()'s call
        counter.mark("optimizer")               # at backward()'s return (optimizer FLOPs: ~0)
        counts = counter.stop()                 # at the step's end: a StepFlops, or None
        ...
        counter.close()                         # the run ends or fails: leave no mode behind

    Args:
        owner: the timer's name, for warnings.
        given: ``check_flops_arg``'s result: when set, nothing is counted and every shape has it.
        max_shapes: distinct signatures counted at most.
    """

    def __init__(self, *, owner: str = "PhaseTimer", given: StepFlops | None = None,
                 max_shapes: int = MAX_SHAPES) -> None:
        self.owner = owner
        self.given = given
        self.max_shapes = max_shapes
        self.counts: dict[tuple[Any, ...], StepFlops] = {}
        #: Signatures seen after ``max_shapes`` were counted: steps with them have no count.
        self.uncounted: set[tuple[Any, ...]] = set()
        self.failed: str | None = None  # why counting is off for the run
        self._warned: set[str] = set()
        self._stack: contextlib.ExitStack | None = None  # set while our mode is on the dispatch stack
        self._mode: Any = None
        self._thread: int | None = None
        self.counting = False  # between start() and stop()
        self._sig: tuple[Any, ...] | None = None
        self._phase = ""
        self._last = 0
        self._phases: dict[str, float] = {}
        self._dtypes: dict[Any, float] = {}
        #: The signature the last :meth:`stop` counted.
        self.last_signature: tuple[Any, ...] | None = None

    def known(self, sig: tuple[Any, ...]) -> StepFlops | None:
        """The FLOPs of a step with this signature: the user's, the count made for it, or None."""
        return self.given if self.given is not None else self.counts.get(sig)

    def wants(self, sig: tuple[Any, ...]) -> bool:
        """Whether a step with this signature should be counted: a new shape, room left, counting possible."""
        if self._stack is not None and not self.counting:
            self._leave()  # a mode that could not leave at its step's end
        if self.given is not None or self.failed is not None or self._stack is not None or sig in self.counts:
            return False
        if len(self.counts) >= self.max_shapes:
            if sig not in self.uncounted:
                self.uncounted.add(sig)
                warn_once(log, self._warned, "shapes", f"{self.owner}: the batches have more than {self.max_shapes} "
                          "shapes; steps of a new shape get no FLOP count, and the windows holding them no MFU: pad to "
                          "a few fixed shapes, or pass flops_per_step=")
            return False
        return True

    def start(self, sig: tuple[Any, ...], phase: str = FORWARD) -> bool:
        """Count from now on, the FLOPs going to ``phase``.  False (and a warning, once) when it cannot."""
        self.close()  # a count left open by a step that never ended is not this step's
        if self._stack is not None:
            return False
        why = _cannot_count()
        if why is not None:
            self._give_up(why)
            return False
        stack = contextlib.ExitStack()
        try:
            if hasattr(torch.compiler, "set_stance"):
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.callback(_unfilter, _filter_global_hooks_warning())
            from torch.utils.flop_counter import FlopCounterMode

            mode = stack.enter_context(FlopCounterMode(display=False, custom_mapping=_guarded_formulas(self)))
        except Exception as err:  # noqa: BLE001 - counting is optional; the step must go on
            stack.close()
            self._give_up(f"FlopCounterMode could not start ({type(err).__name__}: {err})")
            return False
        self._stack, self._mode, self._thread = stack, mode, threading.get_ident()
        self.counting, self._sig, self._phase, self._last, self._phases = True, sig, phase, 0, {}
        self._dtypes = {}
        return True

    def mark(self, phase: str) -> None:
        """A boundary: the FLOPs since the last one are the phase that ends here's; from now on, ``phase``'s."""
        if not self.counting:
            return
        total = self._mode.get_total_flops()  # a sum of Python ints kept on the host
        self._phases[self._phase] = self._phases.get(self._phase, 0.0) + (total - self._last)
        self._phase, self._last = phase, total

    def stop(self, drop: tuple[str, ...] = ()) -> StepFlops | None:
        """The step's end: the count, kept for its signature (None if nothing could be counted).
        ``drop``: phases whose FLOPs are not the step's (an evaluation paused inside it)."""
        if not self.counting:
            return None
        self.mark("")
        phases, sig = {p: f for p, f in self._phases.items() if p and p not in drop}, self._sig
        self.last_signature = sig
        self.close()
        if self.failed is not None or sig is None:
            return None
        if not any(phases.values()):
            self._give_up("FlopCounterMode counted no FLOPs in a step (its kernels are ones it has no formula "
                          "for: custom, fused or CPU attention kernels)")
            return None
        counts = self.counts[sig] = StepFlops(phases, COUNTED, dtypes=dict(self._dtypes))
        return counts

    def _note(self, args: tuple[Any, ...], flops: int) -> None:
        """A counted op's FLOPs under the dtype of its first tensor argument (the matmul's input)."""
        if flops:
            dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
            self._dtypes[dtype] = self._dtypes.get(dtype, 0) + flops

    def close(self) -> None:
        """Stop counting and leave the mode, whatever state the step is in (a failed step, the run's end)."""
        self.counting = False
        self._leave()

    def _leave(self) -> None:
        """Dispatch modes leave in the order they came: with another mode entered during the step still on,
        leaving would take that one out instead of ours.  Then ours stays (counting nothing this class
        reads) and leaves at the next ``wants``, ``start`` or ``close`` that finds it innermost."""
        if self._stack is None:
            return
        if self._thread != threading.get_ident():
            warn_once(log, self._warned, "thread", f"{self.owner}: the FLOP count was stopped on another thread than "
                      "it started on; a dispatch mode is its thread's own, so it stays on there", stacklevel=4)
            self._stack = self._mode = None
            return
        if not _on_top(self._mode):
            warn_once(log, self._warned, "order", f"{self.owner}: a dispatch mode entered during the FLOP-counted "
                      "step is still on at its end; FlopCounterMode leaves after it", stacklevel=4)
            return
        stack, self._stack, self._mode = self._stack, None, None
        try:
            stack.close()
        except Exception as err:  # noqa: BLE001 - never raise into training
            self._give_up(f"FlopCounterMode did not close cleanly ({type(err).__name__}: {err})")

    def _give_up(self, why: str) -> None:
        self.failed = self.failed or why
        warn_once(log, self._warned, "failed", f"{self.owner}: no FLOPs counted: {why}; pass flops_per_step= "
                  "(and peak_tflops= for an unlisted device) for MFU", stacklevel=3)


def _filter_global_hooks_warning() -> Any:
    """Ignore torch.compile's warning about FlopCounterMode's global module hooks, for the counted step.
    (Not ``catch_warnings``: leaving it restores the warning state of the step's start, undoing whatever
    the training code did to it in between.)"""
    warnings.filterwarnings("ignore", message=_GLOBAL_HOOKS_WARNING, category=UserWarning)
    return warnings.filters[0]


def _unfilter(entry: Any) -> None:
    if entry in warnings.filters:
        warnings.filters.remove(entry)
        getattr(warnings, "_filters_mutated", lambda: None)()  # the warnings cache, where Python has one


def _on_top(mode: Any) -> bool:
    """Whether FlopCounterMode ``mode`` is the innermost dispatch mode (its inner mode, where it has one)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is (getattr(mode, "mode", None) or mode)


def _cannot_count() -> str | None:
    """Why counting would harm the run here, or None."""
    if not hasattr(torch.compiler, "set_stance"):
        import sys

        dynamo = sys.modules.get("torch._dynamo")
        frames = getattr(getattr(dynamo, "utils", None), "counters", {}).get("frames", {}) if dynamo else {}
        if frames.get("ok", 0):
            return (f"torch {torch.__version__} has no torch.compiler.set_stance, and FlopCounterMode would leave "
                    "the compiled model uncompiled for the rest of the run")
    return None


def _guarded_formulas(counter: FlopCounter) -> dict[Any, Any]:
    """torch's formulas, each made unable to raise into the training step: a formula that fails
    (an unexpected shape) counts 0 and turns counting off for the run, with a warning."""
    from torch.utils.flop_counter import flop_registry

    def guard(formula: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> int:
            try:
                flops = formula(*args, **kwargs)
                counter._note(args, flops)
                return flops
            except Exception as err:  # noqa: BLE001
                counter._give_up(f"a FLOP formula failed ({type(err).__name__}: {err})")
                return 0

        # Already shape-wrapped: FlopCounterMode must not wrap it again.
        count._get_raw = True  # type: ignore[attr-defined]
        return count

    return {op: guard(formula) for op, formula in flop_registry.items()}


def gpt2_flops_per_token(config: Any, seq_len: int) -> int:
    """The analytic FLOPs of training one token of a GPT-2 (forward + backward, no recompute):
    ``6 * N + 12 * L * d * T``.

    ``N`` is the weights that enter a matmul: per layer ``4 d^2`` (q, k, v, the attention's output) and
    ``2 d d_ff`` (the MLP), and the LM head's ``d V`` (a matmul even when tied to the token embedding);
    not the position embedding, biases or LayerNorms, which no matmul multiplies.  A matmul by a
    ``d_in x d_out`` weight costs ``2 d_in d_out`` FLOPs a token forward and twice that backward: ``6 N``.
    Attention's ``QK^T`` and ``PV`` cost ``2 T d`` each a token and layer forward (``L`` layers, ``d = H Q``
    for ``H`` heads of size ``Q``, ``T`` the sequence): ``12 L d T`` with backward, the whole ``T x T``
    counted, causal or not (PaLM's and torchtitan's convention; FlashAttention's recompute left out).
    """
    layers, d, vocab = config.n_layer, config.n_embd, config.vocab_size
    d_ff = getattr(config, "n_inner", None) or 4 * d
    n_matmul = layers * (4 * d * d + 2 * d * d_ff) + d * vocab
    return 6 * n_matmul + 12 * layers * d * seq_len
