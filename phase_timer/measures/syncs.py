"""The sync census: which host-device synchronizations one step makes, in which phase, from which line.

A loop that reads a value on the host inside its step (``loss.item()``, ``if torch.isnan(loss)``,
``tensor.cpu()``) makes the host wait for the device there, so the host can never queue work
ahead.  The verdict can see *that* the host never gets ahead; this census says *where* it is
held.  On one warm-up step (untimed: the census costs host time) it turns on torch's own sync
check (``torch.cuda.set_sync_debug_mode("warn")``), hears each warning it raises on the
training thread, and keeps the phase the boundaries say runs then and the first frames of the
Python stack outside torch and phase-timer.  A site whose code is known (the 🤗 Trainer's own
checks, a GradScaler) is named with the setting that causes it (:data:`KNOWN_CAUSES`).

What torch's check flags: a read of a device value on the host (``.item()``, ``bool(tensor)``,
``.cpu()``/``.tolist()``, ``nonzero``, a blocking copy), a stream's ``synchronize()``.  Not
flagged: ``torch.cuda.synchronize()``, an event's ``synchronize()``, and waits the driver makes
by itself (a full launch queue, ``cudaFree``).  The census never runs when the user has turned
the check on themselves, nor on the host clock.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phase_timer.measure import Measure
from phase_timer.phases import PAUSED

#: The warning torch raises for each synchronizing operation while the check is on.
MESSAGE = "called a synchronizing CUDA operation"
#: Frames in phase-timer, torch and the warnings module are the mechanism, not the site: the site is the
#: first frame outside them.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package, every subpackage
#: Sites kept per census (a loop that syncs thousands of times a step is told by its count).
MAX_SITES = 16
#: Frames kept per site, innermost first.
FRAMES = 3
#: A census still on after this long was left on (a loop that raised and never closed its timer): it stops.
MAX_SECONDS = 60.0


#: Code whose syncs have a known cause: (a path ending, a function name or None, source text or None) -> the cause
#: and what turns it off.  Matched against every frame of a site (torch's own too).
KNOWN_CAUSES: tuple[tuple[str, str | None, str | None, str], ...] = (
    ("transformers/trainer.py", None, "isnan(tr_loss_step)",
     "TrainingArguments(logging_nan_inf_filter=True), the default: each micro-batch's loss is checked for nan/inf "
     "on the host; logging_nan_inf_filter=False turns it off"),
    ("transformers/trainer.py", "_track_num_input_tokens", None,
     "TrainingArguments(include_num_input_tokens_seen=...): the tokens of each micro-batch are counted on the "
     "host; include_num_input_tokens_seen='no' turns it off"),
    ("transformers/trainer.py", "_maybe_log_save_evaluate", None,
     "the Trainer's logging: the loss (and grad norm) are read at every logging_steps-th step; a larger "
     "logging_steps reads them less often"),
    ("transformers/trainer.py", "_get_learning_rate", None,
     "the learning rate is a tensor, read on the host every step (a scheduler that returns tensors)"),
    ("accelerate/utils/operations.py", "send_to_device", None,
     "accelerate copies each batch to the device with a blocking copy (in the fetch); "
     "TrainingArguments(accelerator_config={'non_blocking': True}) with pinned memory (dataloader_pin_memory=True, "
     "the default) makes the copy asynchronous"),
    ("transformers/masking_utils.py", "find_packed_sequence_indices", None,
     "the model's causal-mask code (transformers) checks the position ids for packed sequences on the host, every "
     "forward; no setting turns it off (with an attention_mask in the batch it checks that instead)"),
    ("transformers/masking_utils.py", "_ignore_causal_mask_sdpa", None,
     "the model's causal-mask code (transformers) checks on the host whether the attention_mask is all ones, "
     "every forward; no setting turns it off"),
    ("torch/amp/grad_scaler.py", None, None,
     "a GradScaler (fp16): each step reads on the host whether the gradients overflowed; bf16 needs no scaler"),
)


@dataclass
class SyncSite:
    """One place a step synchronized: the phase, where (innermost frame first), how often, and why if known."""

    phase: str
    frames: tuple[str, ...]
    code: str
    count: int = 1
    cause: str | None = None

    @property
    def where(self) -> str:
        return " <- ".join(self.frames) if self.frames else "(no Python frame: inside torch's own thread)"

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "where": self.where, "code": self.code, "count": self.count, "cause": self.cause}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SyncSite:
        where = d.get("where") or ""
        return cls(d["phase"], tuple(where.split(" <- ")) if where else (), d.get("code") or "", d.get("count", 1),
                   d.get("cause"))


def _torch_mode() -> tuple[Callable[[], int], Callable[[int], None]]:
    import torch

    return torch.cuda.get_sync_debug_mode, torch.cuda.set_sync_debug_mode


class SyncCensus:
    """Turns torch's sync check on for a span of the training thread and keeps what it hears.

    ``phase_now()`` names the phase running when a sync is heard.  ``mode`` is torch's
    ``(get_sync_debug_mode, set_sync_debug_mode)`` (a test passes its own pair).

    What it changes, it puts back at :meth:`stop` and nothing else: its own two warnings filters
    (removed by identity, so the user's filters added meanwhile stay), ``warnings.showwarning``
    (if it is still the census's), and the check (if it is still the census's level).  A census
    that nobody stops (a loop that raised and never closed its timer) stops itself at the first
    sync after :data:`MAX_SECONDS`.
    """

    def __init__(self, phase_now: Callable[[], str],
                 mode: tuple[Callable[[], int], Callable[[int], None]] | None = None) -> None:
        self._phase_now = phase_now
        self._mode = mode
        self.sites: list[SyncSite] = []
        #: Syncs heard in the training loop (all sites, those past MAX_SITES too); syncs of other threads
        #: outside ``backward`` (not the loop's); syncs in a pause (evaluation, a checkpoint: not a step's).
        self.count = 0
        self.other_threads = 0
        self.paused = 0
        #: "done", "running", or why it did not run.
        self.status = "not run"
        self._running = False
        self._filters: list[Any] = []
        self._shown: Any = None
        self._thread = 0
        self._t0 = 0.0
        self._by_line: dict[tuple[str, str, int], SyncSite | None] = {}

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> bool:
        """Turn the check on (not if the user has it on: theirs stays as it is). Never raises."""
        if self._running:
            return True
        try:
            get, set_mode = self._mode or _torch_mode()
            if get() != 0:
                self.status = "not run: torch.cuda.set_sync_debug_mode is already on (the user's own)"
                return False
            self._running = True
            for action, message in (("ignore", "Synchronization debug mode is a prototype"),  # torch's, once
                                    ("always", MESSAGE)):
                warnings.filterwarnings(action, message=message)
                self._filters.append(warnings.filters[0])
            self._shown = warnings.showwarning
            warnings.showwarning = self._heard
            self._thread = threading.get_ident()
            self._t0 = time.monotonic()
            set_mode(1)
        except Exception as err:  # noqa: BLE001 - the census is a nicety: never break training for it
            self._undo()
            self.status = f"not run: {type(err).__name__}: {err}"
            return False
        self.status = "running"
        return True

    def stop(self) -> None:
        """Turn the check off again and give the warnings machinery back. Never raises."""
        if not self._running:
            return
        try:
            get, set_mode = self._mode or _torch_mode()
            if get() == 1:  # ours: a level the user set meanwhile stays
                set_mode(0)
        except Exception:  # noqa: BLE001
            pass
        self._undo()
        self.status = "done"

    def _undo(self) -> None:
        self._running = False
        if self._shown is not None and warnings.showwarning == self._heard:
            warnings.showwarning = self._shown
        self._shown = None
        for f in self._filters:
            for k, g in enumerate(warnings.filters):
                if g is f:
                    del warnings.filters[k]
                    break
        self._filters = []
        mutated = getattr(warnings, "_filters_mutated", None)  # what filterwarnings itself calls
        if mutated is not None:
            mutated()

    # -- hearing a sync -------------------------------------------------------------------
    def _heard(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
               line: Any = None) -> None:
        if MESSAGE not in str(message) or not self._running:
            (self._shown or warnings._showwarning_orig)(message, category, filename, lineno, file, line)  # others', as before
            return
        try:
            self._count(filename, lineno)
        except Exception:  # noqa: BLE001 - a failure here would surface as an error of the user's .item()
            pass

    def _count(self, filename: str, lineno: int) -> None:
        if time.monotonic() - self._t0 > MAX_SECONDS:  # left on by a loop that never closed its timer
            self.stop()
            return
        phase = self._phase_now()
        if threading.get_ident() != self._thread and phase != "backward":  # autograd's thread runs backward's hooks
            self.other_threads += 1
            return
        if phase == PAUSED:
            self.paused += 1
            return
        self.count += 1
        key = (phase, filename, lineno or 0)
        if key not in self._by_line:  # a line heard before costs a lookup, not a walk of the stack
            site = None
            if len(self.sites) < MAX_SITES:
                frames, code, cause = _site(sys._getframe(2), filename, lineno)
                site = next((s for s in self.sites if s.phase == phase and s.frames[:1] == frames[:1]), None)
                if site is None:
                    site = SyncSite(phase, frames, code, 0, cause)
                    self.sites.append(site)
            self._by_line[key] = site
        site = self._by_line[key]
        if site is not None:
            site.count += 1


def _short(path: str) -> str:
    """``.../site-packages/transformers/trainer.py`` -> ``transformers/trainer.py``; a user's file: its last two parts."""
    parts = path.replace(os.sep, "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return "/".join(parts[-2:])


def _is_mechanism(path: str) -> bool:
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(torch.__file__) + os.sep if torch is not None and torch.__file__ else None
    return (path.startswith(_OURS) or (torch_dir is not None and path.startswith(torch_dir))
            or path in (warnings.__file__, "<frozen warnings>"))


def _site(frame: Any, filename: str, lineno: int) -> tuple[tuple[str, ...], str, str | None]:
    """The first frames outside torch and phase-timer, from the one torch named (``filename:lineno``) outwards."""
    stack = []
    f = frame
    while f is not None:
        stack.append(f)
        f = f.f_back
    start = next((i for i, f in enumerate(stack) if f.f_code.co_filename == filename and f.f_lineno == lineno), 0)
    frames: list[str] = []
    code = ""
    cause = None
    for f in stack[start:]:
        path, fn, no = f.f_code.co_filename, f.f_code.co_name, f.f_lineno or 0
        text = linecache.getline(path, no).strip()
        short = _short(path)
        if cause is None:
            cause = _cause(short, fn, text)
        if _is_mechanism(path):
            continue
        if not frames:
            code = text
        frames.append(f"{short}:{no} in {fn}")
        if len(frames) == FRAMES:
            break
    return tuple(frames), code, cause


def _cause(short: str, function: str, text: str) -> str | None:
    for path, fn, snippet, cause in KNOWN_CAUSES:
        if short.endswith(path) and (fn is None or fn == function) and (snippet is None or snippet in text):
            return cause
    return None


class Syncs(Measure):
    """The census as a measure: what it heard on its warm-up step, for the summary file (``syncs``), the table, the
    verdict's rules (``diagnose(syncs=...)``) and the doors' ``syncs`` and ``sync_census``.

    The boundaries run the census (:class:`phase_timer.run.census_steps.CensusSteps`, on the measure that listens
    to their core): they set :attr:`status` where it cannot run, and hand it the census when it has (:meth:`add`).
    Nothing here runs on a step: a run without its census (a core made without this measure) has no block.
    """

    key = "syncs"
    #: The table puts this line under the run's own (memory, own cost), not among the measures' lines.
    foot = True

    def __init__(self) -> None:
        #: "done", or why the census did not run.
        self.status = "not run"
        #: The warm-up step it ran on (the name ``step`` is the protocol's hook).
        self.warmup_step: int | None = None
        self.sites: list[SyncSite] = []
        self.count = 0
        #: Syncs on that step that were no step's: other threads outside backward, pauses (evaluation, saves).
        self.other_threads = 0
        self.paused = 0

    def census(self, phase_now: Any) -> SyncCensus:
        """A census for the boundaries to start and stop (``phase_now()``: the phase that runs)."""
        return SyncCensus(phase_now)

    def add(self, census: SyncCensus, step: int) -> None:
        """What the census heard on warm-up step ``step``."""
        if census.status == "not run":
            self.status = "not run: the run ended before its last warm-up step"
            return
        self.status = census.status
        if census.status == "done":
            self.warmup_step, self.sites, self.count = step, list(census.sites), census.count
            self.other_threads, self.paused = census.other_threads, census.paused

    def summary(self) -> dict[str, Any]:
        return {"census": self.status, "step": self.warmup_step, "count": self.count, "other_threads": self.other_threads,
                "paused": self.paused, "sites": [site.as_dict() for site in self.sites]}

    def line(self) -> str | None:
        return format_census(self.status, self.warmup_step, self.sites, self.count, self.paused)

    def verdict(self) -> dict[str, Any]:
        return {"syncs": self}


def format_census(status: str, step: int | None, sites: list[SyncSite], count: int, paused: int = 0) -> str | None:
    """One line for the printed summary (None when the census did not run: nothing to say on a CPU run)."""
    if status != "done":
        return None
    head = f"host-device syncs (torch's check, on warm-up step {step}):"
    aside = f" (and {paused} in evaluation or a checkpoint: no step's)" if paused else ""
    if not count:
        return f"{head} none{aside}"
    listed = "; ".join(f"{s.count}x {s.phase} at {s.frames[0] if s.frames else s.where}" for s in sites[:4])
    more = f"; {len(sites) - 4} more sites" if len(sites) > 4 else ""
    return f"{head} {count} a step: {listed}{more}{aside}"
