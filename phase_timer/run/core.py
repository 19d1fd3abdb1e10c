"""The framework-free core: hooks -> engine (marks, records, lazy resolution, window) -> stats -> sinks.

Both doors (the Lightning callback and the plain-PyTorch attachment) turn their
framework's events into boundaries (:mod:`phase_timer.run.boundaries`), which make
these calls on :class:`TimingCore`: ``begin_step(step, phase)``, ``phase(name)``,
``relabel(name)``, ``add_host(name, ms)``, ``end()`` (the step's device part ends),
``close()`` (the record ends: the time between steps too), ``discard()``,
``pause()/resume()`` and ``finish()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from phase_timer._env import warn
from phase_timer.timing.clock import Clock
from phase_timer.diagnosis import Diagnosis, Signals, diagnose
from phase_timer.timing.engine import POLL_EVERY, make_engine
from phase_timer.measure import Measure
from phase_timer.outputs.table import files_line, format_own_cost, run_table
from phase_timer.outputs.tags import (
    IN_FLIGHT_TAG,
    SKIPPED_TAG,
    WINDOW_STEPS_TAG,
    rank_scalars,
    step_scalars,
    window_scalars,
)
from phase_timer.run.conclude import conclude, finished_now, live_view, write_trace
from phase_timer.run.own_cost import host_ahead, run_figures
from phase_timer.distributed.ranks import RankExchange, RankWindow
from phase_timer.phases import EXPOSED_WAIT
from phase_timer.outputs.sinks import BackgroundSink, GuardedSink, Sink
from phase_timer.timing.stats import RunTotals, WindowSeries
from phase_timer.outputs.trace import TraceWriter

log = logging.getLogger(__name__)



def _guarded(sinks: Sequence[Sink]) -> list[Sink]:
    """Each sink behind a guard: its first failure warns, training and the run's end go on."""
    return [s if isinstance(s, (GuardedSink, BackgroundSink)) else GuardedSink(s, type(s).__name__) for s in sinks]


class TimingCore:
    """One run's timing: which steps are recorded, their resolution, statistics and output."""

    #: What the boundaries' C path (``_native.Fast``) reads and writes at every step, where CPython keeps it (no
    #: attribute lookup): the one list of these names, in the order of ``native/fast.c``'s enum, which takes their
    #: offsets from it.  Everything else in ``__dict__``.
    FAST_SLOTS = ("_in_step", "_last_end", "_poll_in", "steps_begun", "_warmup", "closed", "trace", "ranks", "_engine")
    __slots__ = (*FAST_SLOTS, "__dict__")

    def __init__(
        self,
        clock: Clock,
        sinks: Sequence[Sink] = (),
        *,
        window: int,
        warmup_steps: int,
        max_pending: int,
        per_step: bool = False,
        poll_lag: int = 2,
        nvtx: bool = False,
        trace: TraceWriter | None = None,
        ranks: RankExchange | None = None,
        measures: Sequence[Measure] = (),
    ) -> None:
        self.clock = clock
        self.trace = trace
        self._engine = make_engine(
            clock, window=window, max_pending=max_pending, lag=poll_lag, per_step=per_step, nvtx=nvtx,
            traced=trace is not None,
        )
        self._sinks = _guarded(sinks)
        self._window_size = window
        self._warmup = warmup_steps
        self.totals = RunTotals()
        #: What listens to the results (:mod:`phase_timer.measure`), in the order it is called: ``measures`` (the
        #: doors' assembly registers them, ``doors/assemble.py``; a core made by hand that reads memory per phase is
        #: given ``measures.memory.Memory.listening(clock)``).  The core imports none: it finds one by its key.
        self.measures: list[Measure] = list(measures)
        self._rows: list[tuple[int, dict[str, float]]] = []  # values of steps the windows have not reached yet
        #: Each window's statistics, in bounded memory: the run's own noise, for ``phase-timer compare``.
        self.series = WindowSeries()
        self.steps_begun = 0
        self.steps_ended = 0
        self.ranks = ranks
        self.skipped = 0
        self.closed = False
        #: Why no step was timed, when none was (set at the end; the summary says it).
        self.untimed_reason: str | None = None
        #: What the diagnosis reads: sampled steps, windows' spread, the ranks' windows.
        self.signals = Signals()
        self.signals.series = self.series  # RUN_CHANGED reads the windows in order
        #: Host time spent at window ends during the run (statistics, CPU readings, writes queued, the ranks'
        #: exchange): spread over the steps by the own-cost line, taken out of the samples it falls in.
        self.window_ns = 0
        #: What the door knows of the run (loader settings, precision, optimizers, configuration).
        self.context: dict = {}
        #: Where rank zero writes the run summary file at the end (None: nowhere).
        self.summary_dir: str | None = None
        #: Where the TensorBoard values go (None: nowhere), and why none go when the package is missing.
        self.log_dir: str | None = None
        self.outputs_missing: str | None = None
        self.diagnosis: Diagnosis | None = None
        self.summary_path: str | None = None
        #: The summary file's name (None: ``phase_timer_summary.json``; a rank other than zero that ran out of
        #: memory writes ``phase_timer_summary.rank<r>.json``).
        self.summary_name: str | None = None
        self.interrupted = False
        #: Added to a step's index where it is logged (the 🤗 door: the Trainer logs step k at global_step k+1).
        self.log_step_offset = 0
        # Steps in flight are read on the device's clock only: on the host's, nothing is in flight.
        self._flight = clock.kind != "host"
        self._flight_sum = self._flight_n = 0
        self._last_written_step = 0
        self._in_step = False
        self._last_end: int | None = None
        self._paused_at: int | None = None
        #: Host time paused (evaluation, saves, epoch ends: no step's, out of ``period``) and the pauses, since the
        #: last window: the rank report carries them, so that rank zero sees a rank's pauses the others wait for.
        self._paused_ms = 0.0
        self._pauses = 0
        self._poll_in = POLL_EVERY  # closes until the next poll
        # The hot path: the engine's own methods (C functions with the C engine), no extra frame.
        self.phase = self._engine.switch
        self.relabel = self._engine.relabel
        self.add_host = self._engine.add_host
        self.end = self._engine.end

    # -- the step ---------------------------------------------------------------
    @property
    def recording(self) -> bool:
        return self._engine.is_open

    @property
    def current_phase(self) -> str | None:
        return self._engine.current

    @property
    def pending(self) -> int:
        return self._engine.pending

    def begin_step(self, step: int, phase: str) -> None:
        """Open step ``step`` with ``phase`` as its first span (unless warming up or full)."""
        if self.closed:
            return
        self._in_step = True
        self.steps_begun += 1
        if self.steps_begun <= self._warmup:
            return
        engine = self._engine
        if engine.full:
            self._consume(engine.poll())
            if engine.full:
                self._skip()
                return
        trace = self.trace
        if trace is not None and trace.wants(step):  # traced runs have the Python engine
            if trace.ref is None:  # the one reference every traced mark is measured against
                trace.ref_host_ns = time.perf_counter_ns()
                trace.ref = self.clock.mark()
            engine.open(step, phase, trace.ref)
        else:
            engine.open(step, phase)

    def close(self, count_in_flight: bool = False) -> None:
        """Close the record (after :meth:`end`, the time between steps ends here); resolve what the device finished.

        ``count_in_flight`` (one close in 16): also count the steps in flight, after the poll.
        """
        if not self._in_step:
            return
        self._in_step = False
        # Closed while paused (an evaluation after the last step, nothing resumed): the period ends where the
        # pause began, and a resume moves the next period's start past the pause as usual.
        now = self._paused_at if self._paused_at is not None else time.perf_counter_ns()
        last, self._last_end = self._last_end, now
        engine = self._engine
        engine.close((now - last) / 1e6 if last is not None else -1.0)
        if self._paused_at is not None:  # the rest of the pause is no record's: the next period is the host's
            engine.cut()
        # Every POLL_EVERY closes (and at a close that counts the steps in flight, which reads the poll's answer).
        self._poll_in -= 1
        if self._poll_in > 0 and not count_in_flight:
            if self.ranks is not None:
                self._rank_close()
            return
        self._poll_in = POLL_EVERY
        results = engine.poll()  # None unless a window (or, per_step, a step) is ready
        if count_in_flight:
            self._count_flight()
        if results is not None:
            self._consume(results)
        if self.ranks is not None:
            self._rank_close()

    def _count_flight(self) -> None:
        """At a close that counts them, after its poll: the steps in flight (device clock only)."""
        if self._flight:
            # No wait: the poll's own answer, or a query of an older step's last mark.
            engine = self._engine
            n = engine.in_flight()
            if n == 0:  # every earlier step is done: is the one just ended done too (the device idle now)?
                self.signals.tail_checked += 1
                self.signals.tail_busy += not engine.newest_done()
            self.signals.flight[n] += 1
            self._flight_sum += n
            self._flight_n += 1

    def _rank_close(self) -> None:
        # Every rank ends the same steps, so every rank reports at the same ones.
        self.steps_ended += 1
        if self.steps_ended % self._window_size == 0:
            t0 = time.perf_counter_ns()
            self._write_ranks(self.ranks.exchange())
            self.window_ns += time.perf_counter_ns() - t0

    def untime(self) -> None:
        """The step just begun goes untimed, as a warm-up step does (its FLOPs are being counted: it runs slower):
        its record is dropped, and its close still ends the host's clock, so the next step's ``period`` is its own."""
        if self._in_step:
            self._engine.discard()

    def discard(self) -> None:
        """Drop the open record: a step abandoned before its end has no honest total.

        The next step's ``period`` starts here, so it does not carry the dropped batch either.
        """
        self._engine.discard()
        self._in_step = False
        if self._last_end is not None:
            self._last_end = time.perf_counter_ns()

    def probe_behind(self) -> None:
        """At a sampled step's boundary: has the device not yet begun the span the host just issued?

        One query of a mark a phase old, never a wait (device clock only): a device more than a phase
        behind inside the step is busy, even when the host is held to its pace (a full launch queue).
        """
        if self._flight:
            behind = self._engine.behind()
            if behind is not None:
                self.signals.behind_checked += 1
                self.signals.behind += behind

    def add_row(self, step: int, scalars: dict[str, float]) -> None:
        """Values of step ``step``, known now (a memory step's, as it closes): they go to the sinks just before the
        first write at that step or later, so that every sink sees its steps in order (the windows are resolved
        steps later; a logger such as W&B wants a step that never goes back)."""
        if self._sinks:
            self._rows.append((step, scalars))

    def add_sample(self, own_ns: int, host_step_ms: float) -> None:
        """A sampled step: phase-timer's own host time on it, and the host's time from its begin to its end."""
        self.signals.own_ns.append(own_ns)
        self.signals.host_step_ms.append(host_step_ms)

    @property
    def own_us_per_step(self) -> float | None:
        """phase-timer's own host time per step (µs): an ordinary step's, plus the sampled work amortized
        (:meth:`own_cost`); None before a sampled step."""
        own = self.own_cost()
        return own["us_per_step"] if own is not None else None

    def own_cost(self) -> dict | None:
        """The own-cost figures (µs; ``own_cost.estimate``), with the share of ``period`` and whether the host ran
        ahead; None before a sampled step."""
        return run_figures(self)

    def _skip(self) -> None:
        self.skipped += 1
        if self.skipped == 1:
            msg = (
                f"phase-timer: {self._engine.max_pending} steps are still running on the device, the "
                "`max_pending` bound; steps are left untimed until the device catches up (counted in "
                f"{SKIPPED_TAG}). Raise `max_pending` to time them all."
            )
            warn(log, msg, 3)

    def pause(self) -> None:
        """Stop the host clock of ``period`` (validation inside training, epoch ends)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter_ns()
            if not self._in_step:  # a pause no record holds: the next record's period is the host's
                self._engine.cut()

    def resume(self) -> None:
        if self._paused_at is None:
            return
        now = time.perf_counter_ns()
        if self._last_end is not None:
            self._last_end += now - self._paused_at
            self._paused_ms += (now - self._paused_at) / 1e6  # a pause inside training (not before the first step)
            self._pauses += 1
        self._paused_at = None

    # -- results ----------------------------------------------------------------
    def _consume(self, results: list[tuple] | None) -> None:
        """The engine's results, in step order: per-step writes, traced steps, whole windows."""
        t0 = time.perf_counter_ns()
        for item in results or ():
            kind = item[0]
            if kind == "window":
                self._emit(*item[1:])
            elif kind == "step":
                ms = item[2]
                for measure in self.measures:  # each takes its carried values out (a step's are its window's)
                    measure.step(ms)
                self._write(item[1], step_scalars(ms))
            elif kind == "trace" and self.trace is not None:
                self.trace.add(item[1])
        if not self.closed:  # the run's end is no step's
            self.window_ns += time.perf_counter_ns() - t0

    def _emit(self, key: int, last_step: int, steps: int, columns: dict[str, list[float]]) -> None:
        measured: dict[str, float] = {}
        for measure in self.measures:  # each takes its carried values out, and corrects the phases it owns
            measured.update(measure.window(columns))
        # The engines' columns come sorted, each with a value; the statistics and the run totals in one pass.
        summary = self.totals.add_sorted_window(steps, columns)
        exposed = (self.signals.add_wait(steps, summary, {p: len(v) for p, v in columns.items()},
                                         whole=bool(self.context.get("fetch_in_step")))
                   if self.clock.kind != "host" else None)  # the host clock: the whole wait is the loop's
        if self.ranks is not None:
            sent: dict[str, float] = {}
            state: dict[str, float] = {}
            for measure in self.measures:
                sent.update(measure.report())
                state.update(measure.state())
            if exposed is not None:  # a device clock's: rank zero's RANK_STRAGGLER reads it
                sent[EXPOSED_WAIT] = exposed
            if self._pauses:  # the pauses since the last window (rank zero's RANK_STRAGGLER reads them)
                sent.update(paused_ms=self._paused_ms, pauses=float(self._pauses))
                self._paused_ms, self._pauses = 0.0, 0
            self.ranks.add(key, last_step, steps, columns, memory=state or None, counts=sent or None)
        self.signals.add_window(steps, summary)
        self.series.add(last_step, steps, summary, columns)
        scalars = window_scalars(summary)
        scalars[WINDOW_STEPS_TAG] = float(steps)
        if self._flight_n:  # the samples taken since the last window (none: no value, not a zero)
            scalars[IN_FLIGHT_TAG] = self._flight_sum / self._flight_n
            self._flight_sum = self._flight_n = 0
        if self.skipped:
            scalars[SKIPPED_TAG] = float(self.skipped)
        scalars.update(measured)
        self._write(last_step, scalars)

    def add_sink(self, sink: Sink) -> None:
        """One more place the values go from now on (guarded: its first failure warns, training goes on)."""
        self._sinks.extend(_guarded([sink]))

    def live_view(self) -> dict:
        """What the live file adds to the scalars (``run/conclude.py``'s ``live_view``; the live file's thread)."""
        return live_view(self)

    def verdict(self, **extra: Any) -> Diagnosis:
        """The verdict over the run's totals and signals so far, with what the measures hand the rules."""
        for measure in self.measures:  # ``diagnose``'s keywords: memory's summary
            extra.update(measure.verdict())
        return diagnose(self.totals, self.signals, clock=self.clock.kind, context=self.context,
                        rank_totals=self.ranks.totals if self.ranks is not None else None, skipped=self.skipped,
                        warmup_steps=self._warmup, **extra)

    def listen(self, measure: Measure) -> None:
        """``measure`` hears the results from now on, after those already listening."""
        self.measures.append(measure)

    def measure(self, key: str) -> Measure | None:
        """The measure that fills the summary file's block ``key`` (None: none listens)."""
        return next((m for m in self.measures if m.key == key), None)

    @property
    def oom(self) -> dict | None:
        """What was known when an out-of-memory error ended the run (the summary file's ``oom``: the measure that
        fills it, ``phase_timer/measures/oom.py``); None: none did, or no measure listens for one."""
        found = self.measure("oom")
        return found.summary() if found is not None else None


    def _write_ranks(self, windows: list[RankWindow]) -> None:
        for w in windows:
            self.signals.add_rank_window(w.phases, w.step)
            scalars = rank_scalars(w)
            for measure in self.measures:
                scalars.update(measure.job(w))
            self._write(w.step, scalars)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        rows = self._rows
        while rows and rows[0][0] <= step:
            self._write_now(*rows.pop(0))
        self._write_now(step, scalars)

    def _write_now(self, step: int, scalars: dict[str, float]) -> None:
        step += self.log_step_offset
        if step > self._last_written_step:
            self._last_written_step = step
        for sink in self._sinks:
            sink.write(step, scalars)

    def poll(self) -> None:
        """Resolve finished steps now (never waits)."""
        self._consume(self._engine.poll())

    def finish(self, rank_timeout_s: float = 30.0, *, interrupted: bool = False, wait: bool = True) -> RunTotals:
        """End of training: drop a half-done step, wait for the rest, write and close.

        The only place that waits for the device (through the engine's ``drain``), and,
        when distributed, for the other ranks' last reports (at most ``rank_timeout_s``).
        ``wait=False`` (SIGTERM: the process is about to end, and its GPU may be stuck in a
        collective): no wait for the device; the steps it has finished are kept, the rest dropped.
        Safe to call twice; the second call does nothing.
        """
        if self.closed:
            return self.totals
        self.closed = True
        self._sinks = _guarded(self._sinks)  # one added after construction too: the end never raises
        self._engine.discard()  # a step cut off mid-way has no honest total
        self._in_step = False
        try:
            self._consume(self._engine.drain() if wait else finished_now(self._engine))
        except Exception as err:  # noqa: BLE001 - e.g. the device died: keep what was resolved
            msg = f"phase-timer: could not resolve the last steps ({type(err).__name__}: {err})"
            warn(log, msg, 2)
        self._consume(self._engine.flush())
        if self.ranks is not None:
            self._write_ranks(self.ranks.finish(rank_timeout_s, interrupted=interrupted))
        for row in self._rows:  # the last rows (memory steps'), after every resolved step
            self._write_now(*row)
        self._rows = []
        self.interrupted = interrupted
        conclude(self, self._sinks, self._last_written_step)
        for sink in self._sinks:
            sink.close()
        write_trace(self.trace)
        return self.totals

    @property
    def warmup_steps(self) -> int:
        return self._warmup

    @property
    def window(self) -> int:
        """Steps per logging window."""
        return self._window_size

    def summary_table(self, title: str = "phase-timer") -> str:
        """The table printed at the end (``outputs.table.run_table``)."""
        return run_table(self, title)

    def files_line(self) -> str | None:
        """Where this run's files went (rank zero, or a rank given a file of its own: one that ran out of memory);
        None: nowhere."""
        if self.ranks is not None and self.ranks.rank != 0 and self.summary_name is None:
            return None
        return files_line(self.log_dir, self.outputs_missing, self.summary_path)

    # -- memory per phase, as a caller holding the core reads it (the ``memory`` measure's) -----------------
    @property
    def memory(self) -> Any:
        """The memory measure's tracker (``measures.memory.MemoryTracker``; None: memory not read, as on the host
        clock, with ``memory=False``, or on a core made without the measure)."""
        found = self.measure("memory")
        return found.tracker if found is not None else None

    def memory_summary(self) -> dict | None:
        """Memory per phase as the summary file and the rules read it (None: not read)."""
        found = self.measure("memory")
        return found.summary() if found is not None else None

    @property
    def memory_us_per_step(self) -> float | None:
        """Memory's share of the own cost: all its host time, over the steps begun (None: not read)."""
        found = self.measure("memory")
        return found.us_per_step(self.steps_begun) if found is not None else None

    def own_cost_line(self) -> str | None:
        """"phase-timer's own host time: X µs/step (Y% of period): ordinary steps ...", or None before a sampled step."""
        own = self.own_cost()
        return format_own_cost(own) if own is not None else None

    @property
    def host_ahead(self) -> bool | None:
        """The host ran a step or more ahead of the device at most sampled closes (None: not known)."""
        return host_ahead(self.signals.flight)
