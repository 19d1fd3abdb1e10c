"""Throughput and MFU read back: the lines, the side-by-side rows and the figure's panel of ``phase-timer report``.

A run's rates and FLOPs come from its summary file (``throughput`` and, from version 6, ``flops``)
or, for a run without one, from its TensorBoard ``throughput/*`` windows
(:func:`~phase_timer.runs.tensorboard_throughput`).  The lines are the ones the run's own table
printed (:func:`phase_timer.throughput.format_line`, :func:`phase_timer.mfu.format_mfu`), rebuilt
from the file's numbers, so a report says what the run said.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phase_timer.run_summary import FILE_NAME
from phase_timer.runs import MFU_TAGS, PhaseScalars, Points, summary_count_batches

#: The rates a report or compare shows, in order, with their labels.
RATES = {"tokens_per_s": "tokens/s", "samples_per_s": "samples/s", "steps_per_s": "steps/s"}
#: What the MFU panel draws, by the summary file's ``mfu`` keys: line style and label.
_MFU_STYLES = {"step": ("-", "step (model FLOPs over period)"), "forward": ("--", "forward"),
               "backward": (":", "backward")}


def headline_rate(throughput: dict[str, Any] | None) -> str | None:
    """The rate a run is judged by: tokens/s where its batches hold tokens, else samples/s (None: no rates)."""
    if not throughput:
        return None
    return next((k for k in ("tokens_per_s", "samples_per_s") if throughput.get(k) is not None), None)


def throughput_line(throughput: dict[str, Any] | None) -> str | None:
    """``throughput: 36.9k tokens/s, 288.0 samples/s, 3.0 steps/s`` (and the job's), as the run printed it."""
    from phase_timer.throughput import format_line

    if not throughput:
        return None
    rates = {k: throughput[k] for k in RATES if throughput.get(k) is not None}
    line = format_line(rates, throughput.get("job") or None)
    if line and throughput.get("source") == "tensorboard":
        why = "" if throughput.get("summary_skipped") else f"; no {FILE_NAME}"
        line += f" (from TensorBoard's throughput/* scalars, {throughput.get('windows')} windows{why})"
    return line


def format_rate(v: float) -> str:
    """A rate as the run's throughput line writes it (``36.9k``, ``587.2``); below one, three digits."""
    from phase_timer.throughput import _si

    return _si(v) if v >= 1 else f"{v:.3g}"


def _flop(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}FLOP"
    return f"{x:.3g} FLOP"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _peak(peak: dict[str, Any]) -> Any:
    """The file's peak as :func:`~phase_timer.mfu.format_mfu` takes it: a :class:`~phase_timer.peaks.Peak` from the
    table, or the user's ``peak_tflops=`` (no device or precision named) as a number."""
    from phase_timer.peaks import FP8, FP8_NOTE, Peak

    if not peak.get("device") or not peak.get("precision"):
        return float(peak["tflops"])
    return Peak(float(peak["tflops"]), peak["precision"], peak["device"], peak.get("source") or "",
                FP8_NOTE if peak["precision"] == FP8 else None)


def _step_flops(flops: dict[str, Any]) -> Any:
    """The file's mean FLOPs a step as a :class:`~phase_timer.flops.StepFlops` (its recompute, its source)."""
    from phase_timer.flops import BACKWARD, FORWARD, GIVEN, StepFlops

    per = flops.get("per_step") or {}
    source = flops.get("source") or GIVEN
    if per.get("forward") is not None and per.get("backward") is not None:
        return StepFlops({FORWARD: float(per["forward"]), BACKWARD: float(per["backward"])}, source)
    return StepFlops({}, source, given_total=float(per["hardware"])) if per.get("hardware") else None


def flops_line(flops: dict[str, Any] | None) -> str | None:
    """``FLOPs: 3.9 TFLOP a step (forward 1.3 TFLOP, backward 2.6 TFLOP; counted): 402.1 TFLOP/s``."""
    per = (flops or {}).get("per_step") or {}
    if not per.get("model"):
        return None
    split = ", ".join(f"{p} {_flop(per[p])}" for p in ("forward", "backward") if per.get(p) is not None)
    how = {"counted": "counted by FlopCounterMode", "given": "given: flops_per_step="}.get(flops.get("source"), "")
    inner = "; ".join(s for s in (split, how) if s)
    rate = flops.get("tflops_per_s")
    return (f"FLOPs: {_flop(per['model'])} a step{f' ({inner})' if inner else ''}"
            + (f": {rate:.1f} TFLOP/s" if rate is not None else ""))


def mfu_line(flops: dict[str, Any] | None) -> str | None:
    """The MFU line with its denominator (``MFU 41% of 989 TFLOP/s (bf16 dense, H100 SXM): forward 52%, ...``),
    or why there is none (the file's note)."""
    from phase_timer.mfu import format_mfu

    if not flops:
        return None
    mfu, peak = flops.get("mfu") or {}, flops.get("peak")
    phases = {p: mfu[p] for p in ("forward", "backward") if mfu.get(p) is not None}
    if mfu.get("step") is not None and peak:
        return format_mfu(mfu["step"], phases, _peak(peak), _step_flops(flops))
    if mfu.get("step") is not None:  # TensorBoard alone: the ratio without its denominator
        split = "".join(f", {p} {_pct(r)}" for p, r in phases.items())
        return (f"MFU {_pct(mfu['step'])}{split} (from TensorBoard's throughput/mfu* scalars; the peak it is of is "
                f"in the run's {FILE_NAME})")
    note = flops.get("note")
    if not note:
        return None
    return note if note.startswith("MFU") else f"MFU: {note}"


def run_lines(throughput: dict[str, Any] | None, flops: dict[str, Any] | None) -> list[str]:
    """The throughput, FLOPs and MFU lines of one run (none of what it lacks)."""
    return [line for line in (throughput_line(throughput), flops_line(flops), mfu_line(flops)) if line]


def side_by_side_rows(throughputs: Sequence[dict | None], flopses: Sequence[dict | None]) -> list[tuple[str, ...]]:
    """The report's side-by-side rows: each rate and the MFU a run has (blank where it has none)."""
    rows = []
    for key, label in RATES.items():
        if any(t and t.get(key) is not None for t in throughputs):
            rows.append((label, *(format_rate(t[key]) if t and t.get(key) is not None else "" for t in throughputs)))
    mfus = [((f or {}).get("mfu") or {}).get("step") for f in flopses]
    if any(m is not None for m in mfus):
        rows.append(("MFU", *("" if m is None else _pct(m) for m in mfus)))
    return rows


# -- the figure's panel ----------------------------------------------------------------------
def timeline(scalars: PhaseScalars, data: dict[str, Any] | None) -> tuple[dict[str, Points], str | None]:
    """What the panel draws: the headline rate and the MFUs over the run, by the summary's names (``tokens_per_s``
    or ``samples_per_s``; ``step``, ``forward``, ``backward`` for MFU), and where they came from.

    TensorBoard's ``throughput/*`` windows where the run has them (a value per window, exact).  Else the summary
    file's window batches: a rate where every step had the same count (:func:`~phase_timer.runs.summary_count_batches`),
    an MFU as the run's scaled by the run's mean time over the batch's (exact where every step had the same
    FLOPs: one batch shape)."""
    tp = scalars.throughput
    name = headline_rate({k: 1.0 for k in RATES if tp.get(k)})
    if name is not None:
        out = {name: tp[name], **{k: tp[tag] for k, tag in MFU_TAGS.items() if tp.get(tag)}}
        return out, "TensorBoard"
    if not data:
        return {}, None
    out: dict[str, Points] = {}
    batches = summary_count_batches(data)
    name = headline_rate({k: 1.0 for k in RATES if k != "steps_per_s" and batches.get(k)})
    if name is not None:
        out[name] = [(last, count * 1e3 / ms) for _, last, count, ms in batches[name]]
    out.update(_summary_mfu(data))
    return out, (FILE_NAME if out else None)


def _summary_mfu(data: dict[str, Any]) -> dict[str, Points]:
    mfu = ((data.get("flops") or {}).get("mfu")) or {}
    windows, phases = data.get("windows") or {}, data.get("phases") or {}
    columns = windows.get("phases") or {}
    out = {}
    for key, phase in (("step", "period"), ("forward", "forward"), ("backward", "backward")):
        run_ms = (phases.get(phase) or {}).get("mean_ms")
        means = (columns.get(phase) or {}).get("mean_ms") or []
        if mfu.get(key) is not None and run_ms:
            out[key] = [(s, mfu[key] * run_ms / ms) for s, ms in zip(windows.get("last_step") or [], means) if ms]
    return {k: v for k, v in out.items() if v}


def has_panel(timelines: Sequence[dict[str, Points]]) -> bool:
    return any(t for t in timelines)


def draw_rates(ax: Any, timelines: Sequence[dict[str, Points]], labels: list[str], colors: Sequence[str],
               sources: Sequence[str | None]) -> None:
    """Each run's headline rate over the run: tokens/s, or samples/s where a run counts no tokens."""
    names = []
    for j, (tl, label) in enumerate(zip(timelines, labels)):
        name = headline_rate({k: 1.0 for k in ("tokens_per_s", "samples_per_s") if tl.get(k)})
        if name is None:
            continue
        names.append(RATES[name])
        xs, ys = zip(*tl[name])
        ax.plot(xs, ys, color=colors[j % len(colors)], linewidth=1.4, marker="." if len(xs) < 40 else None,
                label=label if len(timelines) == 1 else f"{label}: {RATES[name]}")
    unit = names[0] if len(set(names)) == 1 else "per s"
    ax.set_title(f"throughput over the run ({unit})\nfrom {_sources(sources, labels)}", fontsize=9)
    ax.set_ylabel(unit)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if names:
        ax.legend(fontsize=8, loc="best")


def draw_mfu(ax: Any, timelines: Sequence[dict[str, Points]], labels: list[str], colors: Sequence[str],
             peaks: Sequence[str | None]) -> None:
    """Each run's MFU over the run, in % of its peak: the step's solid, forward's and backward's broken."""
    for j, (tl, label) in enumerate(zip(timelines, labels)):
        for key, (style, name) in _MFU_STYLES.items():
            if tl.get(key):
                xs, ys = zip(*tl[key])
                ax.plot(xs, [100 * y for y in ys], color=colors[j % len(colors)], linestyle=style, linewidth=1.4,
                        label=name if len(timelines) == 1 else f"{label}: {name}")
    shown = [f"{lab}: {p}" if len(labels) > 1 else p for lab, p in zip(labels, peaks) if p]
    ax.set_title("MFU over the run\n% of " + ("; ".join(shown) if shown else "the run's peak"), fontsize=9)
    ax.set_ylabel("% of peak")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def peak_label(flops: dict[str, Any] | None) -> str | None:
    """``989 TFLOP/s bf16 dense, H100 SXM`` (the MFU's denominator), None without a peak."""
    peak = (flops or {}).get("peak")
    if not peak:
        return None
    where = ", ".join(str(v) for v in (f"{peak.get('precision')} dense" if peak.get("precision") else None,
                                       peak.get("device")) if v)
    return f"{peak['tflops']:g} TFLOP/s" + (f" {where}" if where else " (peak_tflops=)")


def _sources(sources: Sequence[str | None], labels: list[str]) -> str:
    how = {"TensorBoard": "TensorBoard's throughput/*, a point per window",
           FILE_NAME: "the summary file's window batches"}
    used = [s for s in how if s in sources]
    if len(used) == 1:
        return how[used[0]]
    return "; ".join(f"{', '.join(lab for lab, s in zip(labels, sources) if s == src)}: {how[src]}" for src in used)
