"""``phase-timer report --png``: the figure of where the step goes, over the run, with memory and throughput panels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phase_timer.cli.errors import ReportError
from phase_timer.cli.rates import RATES, headline_rate, peak_label
from phase_timer.cli.read import Points
from phase_timer.cli.report_runs import RunReport
from phase_timer.cli.report_text import percent, run_labels
from phase_timer.phases import STEP_PHASES, TOTALS, ordered, share_base
from phase_timer.outputs.run_summary import FILE_NAME
from phase_timer.outputs.tags import MEMORY_PREFIX

#: One colour per built-in phase, the same in every panel and every figure (the TensorBoard
#: layout's order); custom phases take the colours after them.
_BUILTIN_COLORS = {
    "data_wait": "#8c564b", "sync_wait": "#e377c2", "h2d": "#9467bd", "forward": "#1f77b4", "backward": "#ff7f0e",
    "optimizer": "#2ca02c", "idle": "#7f7f7f", "between_steps": "#bcbd22", "step": "black", "period": "grey",
}
_OTHER_COLORS = ("#17becf", "#d62728", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2")


def _phase_colors(phases: list[str]) -> dict[str, Any]:
    custom = [p for p in phases if p not in _BUILTIN_COLORS]
    return {**_BUILTIN_COLORS, **{p: _OTHER_COLORS[i % len(_OTHER_COLORS)] for i, p in enumerate(custom)}}


def _device_phases(reports: Sequence[RunReport]) -> list[str]:
    """The step's phases: what its bar is made of."""
    return [p for p in ordered({q for r in reports for q in r.phases}) if share_base(p) == "step"]


def share_bars(reports: Sequence[RunReport]) -> dict[str, list[float]]:
    """What the figure's bars are made of: per step phase (built-in and custom, in order), its share of
    ``step`` in % per run (0 where a run lacks it); a run's widths add up to 100."""
    return {phase: [100 * (r.phases[phase].share or 0.0) if phase in r.phases else 0.0 for r in reports]
            for phase in _device_phases(reports)}


def _draw_shares(ax: Any, reports: Sequence[RunReport], labels: list[str], colors: dict[str, Any]) -> None:
    """Stacked horizontal bars: each step phase's share of ``step``, one bar per run."""
    y = list(range(len(reports)))[::-1]  # the first run on top
    lefts = [0.0] * len(reports)
    for phase, widths in share_bars(reports).items():
        bars = ax.barh(y, widths, left=lefts, color=colors[phase], label=phase, height=0.6)
        ax.bar_label(bars, labels=[f"{w:.0f}%" if w >= 4 else "" for w in widths], label_type="center", fontsize=8, color="white")
        lefts = [a + w for a, w in zip(lefts, widths)]
    ticks = []
    for r, label in zip(reports, labels):
        dw = r.phases.get("data_wait")
        ticks.append(label + (f"\ndata_wait: {percent(dw.share)} of period" if dw is not None and dw.share is not None else ""))
    ax.set_yticks(y, ticks, fontsize=8)
    ax.set_ylim(-1, len(reports))  # bars of a sensible thickness for one run or many
    ax.set_xlim(0, max(100.0, *lefts))
    ax.set_xlabel("share of step (%)")
    ax.set_title("where the step goes (mean)", fontsize=10)


def _draw_distribution(ax: Any, reports: Sequence[RunReport], labels: list[str], colors: dict[str, Any]) -> None:
    """Per phase and run: p50 to p90 (thick), on to p99 or max (thin), the mean (dot); log scale in ms."""
    phases = ordered({p for r in reports for p in r.phases})
    n = len(reports)
    markers = ("o", "s", "^", "D", "v", "P")
    ticks, where = [], []
    for i, phase in enumerate(phases):
        base = (len(phases) - 1 - i) * (n + 1)
        for j, r in enumerate(reports):
            st = r.phases.get(phase)
            if st is None or st.p50_ms is None:
                continue
            yv = base + (n - 1 - j)
            top = st.p99_ms if st.p99_ms is not None else st.max_ms
            lo = max(st.p50_ms, 1e-3)
            ax.plot([lo, max(st.p90_ms or lo, 1e-3)], [yv, yv], color=colors[phase], linewidth=5, solid_capstyle="butt")
            if top is not None:
                ax.plot([max(st.p90_ms or lo, 1e-3), max(top, 1e-3)], [yv, yv], color=colors[phase], linewidth=1.2)
            if st.mean_ms is not None:
                ax.plot([max(st.mean_ms, 1e-3)], [yv], marker=markers[j % len(markers)], color="black", markersize=4)
        ticks.append(phase)
        where.append(base + (n - 1) / 2)
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    ax.set_yticks(where, ticks, fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("ms per step (log scale)")
    exact = all(r.source in ("summary", "step") for r in reports)
    top = "p99" if all(r.source == "summary" for r in reports) else "max"
    how = "over every step" if exact else "(window summaries where no per-step values)"
    title = f"distribution {how}: p50 to p90 thick, on to {top} thin, mean marked"
    if n > 1:
        shapes = ("●", "■", "▲", "◆", "▼", "✚")
        title += "\nruns, top to bottom: " + ", ".join(f"{lab} {shapes[j % len(shapes)]}" for j, lab in enumerate(labels))
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", alpha=0.3, which="both")


def _aligned(points: Points, xs: list[int]) -> list[float]:
    at = dict(points)
    return [at.get(x, 0.0) for x in xs]


def _draw_timeline(ax: Any, report: RunReport, label: str, colors: dict[str, Any]) -> None:
    """The step's phases stacked over the run (window means), the host's waits stacked above them up to
    ``period``; ``step`` and ``period`` as lines; custom phases as thin lines."""
    tl = {p: pts for p, pts in report.timeline.items() if pts}
    xs = sorted({s for pts in tl.values() for s, _ in pts})
    if not xs:
        return
    inside = [p for p in tl if p in STEP_PHASES]
    waits = [p for p in ("data_wait", "sync_wait", "between_steps") if p in tl]
    if inside:
        ax.stackplot(xs, *(_aligned(tl[p], xs) for p in inside), colors=[colors[p] for p in inside], labels=inside,
                     alpha=0.9)
    base = _aligned(tl["step"], xs) if "step" in tl else [sum(v) for v in zip(*(_aligned(tl[p], xs) for p in inside))]
    for p in waits:
        top = [b + v for b, v in zip(base, _aligned(tl[p], xs))]
        ax.fill_between(xs, base, top, color=colors[p], alpha=0.45, label=p, linewidth=0)
        base = top
    for p in TOTALS:
        if p in tl:
            style = {"color": colors[p], "linewidth": 1.4, "linestyle": "-" if p == "step" else "--"}
            ax.plot(*zip(*tl[p]), label=p, **style)
    for p in tl:
        if p not in _BUILTIN_COLORS:
            ax.plot(*zip(*tl[p]), color=colors[p], linewidth=1.2, linestyle=":", label=p)
    what = "window mean" if report.source != "step" else "per step"
    ax.set_title(f"{label}: where the time goes over the run ({what}; the waits stacked above the step)", fontsize=10)
    ax.set_ylabel("ms per step")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(xs[0], xs[-1] if len(xs) > 1 else xs[0] + 1)


#: The memory panel: one line style per quantity, one colour per run.
_MEMORY_STYLES = {"step_begin": ("allocated at the step's begin", "-"), "activations": ("activations", "--"),
                  "peak_allocated": ("peak allocated", ":")}
_RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _draw_memory(ax: Any, reports: Sequence[RunReport], labels: list[str]) -> None:
    """Allocated at the step's begin, activations and the peak allocated over the steps, every run on one scale."""
    top = max(v for r in reports for pts in r.memory_timeline.values() for _, v in pts)
    scale, unit = (1024.0, "GiB") if top >= 1024 else (1.0, "MiB")  # GiB once a value reaches one
    for j, (r, label) in enumerate(zip(reports, labels)):
        for what, pts in r.memory_timeline.items():
            name, style = _MEMORY_STYLES[what]
            xs, ys = zip(*pts)
            ax.plot(xs, [y / scale for y in ys], color=_RUN_COLORS[j % len(_RUN_COLORS)], linestyle=style,
                    linewidth=1.4, marker="." if len(pts) < 40 else None,
                    label=name if len(reports) == 1 else f"{label}: {name}")
    ax.set_title(f"memory over the run ({_memory_sources(reports, labels)})", fontsize=10)
    ax.set_ylabel(unit)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best", ncol=min(3, len(reports)))


def _memory_sources(reports: Sequence[RunReport], labels: list[str]) -> str:
    """Where the memory panel's lines come from; the runs named only where the sources differ."""
    how = {"TensorBoard": f"TensorBoard's {MEMORY_PREFIX}/*, a point per memory step",
           FILE_NAME: "the summary file's samples, its peak and mean activations flat"}
    by = {src: [lab for r, lab in zip(reports, labels) if r.memory_from == src] for src in how}
    used = [src for src in how if by[src]]
    if len(used) == 1:
        return how[used[0]]
    return "; ".join(f"{', '.join(by[src])}: {how[src]}" for src in used)


#: What the MFU panel draws, by the summary file's ``mfu`` keys: line style and label.
_MFU_STYLES = {"step": ("-", "step (model FLOPs over period)"), "forward": ("--", "forward"),
               "backward": (":", "backward")}


def has_panel(timelines: Sequence[dict[str, Points]]) -> bool:
    """Some run has a rate or an MFU to draw: the figure gets a throughput row."""
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


def _sources(sources: Sequence[str | None], labels: list[str]) -> str:
    how = {"TensorBoard": "TensorBoard's throughput/*, a point per window",
           FILE_NAME: "the summary file's window batches"}
    used = [s for s in how if s in sources]
    if len(used) == 1:
        return how[used[0]]
    return "; ".join(f"{', '.join(lab for lab, s in zip(labels, sources) if s == src)}: {how[src]}" for src in used)


def _draw_throughput(fig: Any, cell: Any, reports: Sequence[RunReport], labels: list[str]) -> None:
    """The headline rate over the run (left) and MFU beside it (right), where a run has MFU; one colour per run."""
    timelines = [r.rate_timeline for r in reports]
    with_mfu = any(any(k in t for k in ("step", "forward", "backward")) for t in timelines)
    cells = cell.subgridspec(1, 2, width_ratios=(1, 1.5)) if with_mfu else None
    rate_ax = fig.add_subplot(cells[0, 0] if cells is not None else cell)
    draw_rates(rate_ax, timelines, labels, _RUN_COLORS, [r.rate_from for r in reports])
    if cells is not None:
        draw_mfu(fig.add_subplot(cells[0, 1]), timelines, labels, _RUN_COLORS,
                 [peak_label(r.flops) for r in reports])


def write_png(reports: Sequence[RunReport], path: str) -> None:
    """Shares and the distribution (left), the phases stacked over the run (right, one row per run), into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = run_labels(reports)
    colors = _phase_colors(ordered({p for r in reports for p in r.phases}))
    n = len(reports)
    rows = max(2, n)
    memory = any(r.memory_timeline for r in reports)  # no memory data: no panel, the figure as it was
    throughput = has_panel([r.rate_timeline for r in reports])  # likewise without rates
    extra = int(memory) + int(throughput)
    fig = plt.figure(figsize=(15, 3.0 + 3.0 * n + 3.0 * extra), layout="constrained")
    grid = fig.add_gridspec(rows + extra, 2, width_ratios=(1, 1.5))
    half = max(1, rows // 2)
    _draw_shares(fig.add_subplot(grid[:half, 0]), reports, labels, colors)
    _draw_distribution(fig.add_subplot(grid[half:rows, 0]), reports, labels, colors)
    if n > 1:  # one y scale for every run: heights compare at a glance
        first = fig.add_subplot(grid[0, 1])
        axes = [first] + [fig.add_subplot(grid[i, 1], sharex=first, sharey=first) for i in range(1, n)]
    else:
        axes = [fig.add_subplot(grid[:rows, 1])]
    for ax, r, label in zip(axes, reports, labels):
        _draw_timeline(ax, r, label, colors)
    top = max(ax.get_ylim()[1] for ax in axes)
    for ax in axes:
        ax.set_ylim(0, top)
    axes[-1].set_xlabel("step")
    phase_axes = list(fig.axes)  # the phase legend's: the memory and throughput panels keep their own
    if memory:
        _draw_memory(fig.add_subplot(grid[rows, :]), reports, labels)
    if throughput:
        _draw_throughput(fig, grid[rows + int(memory), :], reports, labels)
    handles = {h.get_label(): h for ax in phase_axes for h in ax.get_legend_handles_labels()[0]}
    names = ordered(list(handles))
    fig.legend([handles[p] for p in names], names, loc="outside lower center", ncol=min(len(names), 10), frameon=False)
    fig.suptitle("phase-timer")
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise ReportError(f"{path}: cannot write the figure ({err.strerror or err})") from err
    finally:
        plt.close(fig)
