"""The keyword arguments every door takes, each written once: its default, its rule, its words.

A door (``PhaseTimer``, ``attach``, ``PhaseTimerCallback``) spells them out in its signature,
which Python and its tools read, and hands its arguments here as they came
(``Options.of("attach", locals())``): one :class:`Options`, checked field by field with the rule
:mod:`phase_timer.config` has for it, so a wrong argument fails at construction naming the call.
The door's docstring takes each argument's entry from here (:func:`entries`); what is the door's
own -- its window's name and default, where its files go -- the door says itself.
``tests/doors/test_options.py`` holds each door's signature to these fields.

The names are spelled in each signature, not generated from here: a ``__signature__`` made from these fields
over ``**kwargs`` would show the same in ``inspect.signature`` and ``help()``, but type checkers and editors read
the source, and would see ``**kwargs`` with no name, type or default (``Unpack`` of a TypedDict gives names and
types, not defaults, and would be a second copy of them).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

from phase_timer import files
from phase_timer.config import (
    check_bool,
    check_count,
    check_flops,
    check_int,
    check_nvtx,
    check_path,
    check_peak,
    check_seconds,
    check_snapshot,
    check_span,
)
from phase_timer.measures.modules import check_modules
from phase_timer.outputs.trace import TraceWriter

#: A rule: ``check(owner, name, value)`` raises a ValueError naming the call, or returns.
Rule = Callable[[str, str, Any], None]


def _option(default: Any, check: Rule, doc: str | None) -> Any:
    """One shared argument: its default, its rule, and its entry in the doors' docstrings (None: each door's own
    words, where the argument means something of the door's).  ``{run}`` and ``{end}`` in the entry become the
    door's run (each ``fit``) and its end (the end of ``fit``)."""
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True)
class Options:
    """The arguments every door takes, checked when made.

    ``window`` (Lightning's ``log_every_n_steps``) is steps per logging window, None for the
    framework's logging interval; ``log_dir`` a directory for files of phase-timer's own: each
    door says when it writes there.  ``owner`` and ``window_arg`` name the call and its window
    in an error.

    Args:
        {options}
    """

    window: int | None = _option(None, partial(check_int, minimum=1, optional=True), None)
    warmup_steps: int = _option(
        5, partial(check_int, minimum=0), "optimizer steps at the start of {run} that are not timed.")
    max_pending: int = _option(
        64, partial(check_int, minimum=1), "steps that may wait for the device before new ones go untimed.")
    per_step: bool = _option(
        False, check_bool, "also write every step's values (``phase_time_step/*``), ~7 scalars a step.")
    summary: bool = _option(True, check_bool, "print the table at {end} (rank zero).")
    log_dir: str | os.PathLike[str] | None = _option(None, partial(check_path, kind="directory"), None)
    nvtx: bool = _option(False, check_nvtx, "also push each phase as an NVTX range (Nsight Systems); off by default.")
    trace_steps: tuple[int, int] | None = _option(
        None, check_span, "``(first, stop)``: write a Chrome/Perfetto trace of these steps' phases on the device's "
        "timeline, at {end}.")
    trace_path: str | os.PathLike[str] | None = _option(
        None, partial(check_path, kind="file"), "the trace's file (default ``<log_dir>/phase_trace.json``).")
    rank_timeout_s: float = _option(
        30.0, check_seconds, "under torch.distributed, how long rank zero waits at {end} for the other ranks' last "
        "reports (after an exception: no wait at all).")
    memory: bool = _option(
        True, check_bool, "on CUDA, read the caching allocator's counters at each boundary of a sampled step (about "
        "one in 128; never a sync, never a reset of the user's peak): memory per phase, the peak's phase, creep and "
        "headroom (``phase_memory/*``).  ``False``: not read.")
    #: A step's samples and tokens for its throughput (``throughput.py``).
    samples_per_batch: int | Callable[[Any], int] | None = _option(
        None, check_count, "a batch's samples, for throughput (``throughput/*``: samples, tokens and steps a second, "
        "from ``period``): ``None`` (default) reads a tensor's leading dimension on the host; or a count, or a "
        "function of the batch.")
    tokens_per_batch: int | Callable[[Any], int] | None = _option(
        None, check_count, "a batch's tokens, for throughput: ``None`` (default) reads the input ids' ``numel`` on "
        "the host (an integer tensor of 2+ dimensions, or a mapping's ``input_ids``), padding included; or a count, "
        "or a function of the batch (e.g. the tokens that are not padding, counted on the host).")
    #: FLOPs and MFU (``step_flops.py``).
    flops_per_step: float | dict[str, float] | None = _option(
        None, check_flops, "the FLOPs of an optimizer step, or ``{\"forward\": f, \"backward\": b}``, for "
        "``throughput/tflops_per_s``, ``throughput/mfu*`` and the table's MFU line.  ``None`` (default) counts "
        "them once per batch shape with ``FlopCounterMode`` on an untimed warm-up step (a new shape later: on its "
        "first step, left untimed).  What is counted, and MFU's definition: ``docs/flops.md``.")
    peak_tflops: float | None = _option(
        None, check_peak, "the device's dense peak in TFLOP/s, for MFU.  ``None`` (default): the table's dense "
        "tensor-core peak for the device and the precision the matmuls ran in (a device the table lacks, and the "
        "CPU, need this argument).")
    mfu: bool = _option(True, check_bool, "``False`` counts no FLOPs and gives no MFU.")
    #: The CUDA allocator's history, dumped on an out-of-memory error (``oom.py``).
    memory_snapshot: bool | str | os.PathLike[str] | None = _option(
        None, check_snapshot, "CUDA: record the caching allocator's history (Python stacks, the last 100,000 "
        "allocations and frees) from the start of {run} and dump a snapshot for https://pytorch.org/memory_viz on "
        "an out-of-memory error: ``True`` writes ``memory_snapshot.pickle`` beside the summary file, ``\"end\"`` "
        "also at {end}, a path writes there.  Off by default: every allocation and free pays for its stack "
        "(``docs/faults.md``).  On a CPU it warns once and records nothing.")
    #: Which module (``measures/modules/``): forward/backward time and activations per module, sampled.
    modules: bool | int | Sequence[str] = _option(
        False, check_modules, "off by default (opt in: a sampled step holds the device behind a gate and is untimed, "
        "which a run must choose: ``docs/modules.md``).  ``True``: on sampled steps (one in ~1,024 after a few early "
        "ones, each on one group of the modules in turn; never the ordinary step), each "
        "module's forward and backward time on the run's clock and (CUDA) the activations it keeps: the model's "
        "top-level children, repeated blocks as one row (``transformer.h[0-11]``, their ``attn``/``mlp`` summed) "
        "(``phase_module/*``, the table, the summary file, the verdict).  An int: every module down to that depth; "
        "a list of names (``model.named_modules()``'s): those; ``False``: off.  A compiled model is not measured "
        "(``docs/modules.md``).")
    #: Whether the door times at all; a run's summary leaves it out (every run written had it on).
    enabled: bool = _option(
        True, check_bool, "``False`` (or ``PHASE_TIMER_DISABLE=1``) times and writes nothing (``totals``: an empty "
        "``RunTotals``).  Under torch.distributed it must be the same on every rank (rank zero expects every "
        "rank's reports); only rank zero writes anyway.")
    #: The call a wrong argument's error names, and what that door calls ``window``.
    owner: str = "PhaseTimer"
    window_arg: str = "window"

    def __post_init__(self) -> None:
        for f in fields(self):  # in order: the first wrong argument is the one named
            if "check" in f.metadata:
                name = self.window_arg if f.name == "window" else f.name
                f.metadata["check"](self.owner, name, getattr(self, f.name))

    @classmethod
    def of(cls, owner: str, args: Mapping[str, Any], *, window: str = "window") -> Options:
        """The options among a door's arguments (its ``locals()``), checked; ``window``: the door's name for it."""
        given = {f.name: args[f.name] for f in fields(cls) if "check" in f.metadata and f.name in args}
        return cls(**{**given, "window": args[window]}, owner=owner, window_arg=window)

    def make_trace(self, log_dir: str | None, clock: str) -> TraceWriter | None:
        """The trace writer for ``trace_steps`` (default file: ``<log_dir>/phase_trace.json``)."""
        if self.trace_steps is None:
            return None
        path = self.trace_path or files.join(log_dir or ".", "phase_trace.json")
        return TraceWriter(path, *self.trace_steps, clock=clock)


def entries(*, run: str, end: str) -> list[str]:
    """Each shared argument's docstring entry, ``name: words``, in a door's terms: ``run``, the run (each
    ``fit``), and ``end``, where it ends (the end of ``fit``; ``close()``)."""
    return [f"{f.name}: " + f.metadata["doc"].replace("{run}", run).replace("{end}", end)
            for f in fields(Options) if f.metadata.get("doc")]


#: A docstring entry's width, its indent included.
_WIDTH = 112


def put(doc: str | None, marker: str, lines: list[str]) -> str | None:
    """``doc`` with its line ``marker`` replaced by ``lines``, each wrapped as an entry at the marker's indent
    (None: a docstring ``python -OO`` dropped)."""
    if doc is None:
        return None
    out: list[str] = []
    for line in doc.split("\n"):
        if line.strip() != marker:
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        for entry in lines:
            out += textwrap.wrap(entry, _WIDTH, initial_indent=indent, subsequent_indent=indent + "    ",
                                 break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


Options.__doc__ = put(Options.__doc__, "{options}", entries(run="the run", end="the run's end"))
