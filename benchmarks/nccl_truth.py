"""The profiler's truth for exposed communication, per step: the union-of-intervals rule on device activities.

Every benchmark that judges ``forward.comm_wait`` + ``backward.comm_wait`` reads its truth here, from a list of
device intervals ``(start_us, end_us, name, kind)`` taken off the profiler (:func:`device_intervals`) or made by
hand (``tests/benchmarks/test_nccl_truth.py``).

- **Activities, not annotations.** With CPU activity on, the profiler also puts GPU-side *annotations* on the
  CUDA device: ProcessGroupNCCL's ``nccl:all_reduce`` spans the same interval as its kernel
  (``ncclDevKernel_AllReduce_...``), and FSDP2's ``FSDP::...`` ranges span the kernels launched inside them.
  Counting both doubles the collectives' time.  Only kernels, memcpy and memset count (an annotation is
  dropped by the event's own flag, or, where a torch lacks it, by name: ``nccl:``/``FSDP::`` and the like).
- **Communication** is an activity whose name holds one of ``comm`` (``"nccl"``: NCCL's kernels; the planted
  spins of the one-GPU benchmark).  **Work** is every other activity.  The *exposed* time is each
  communication interval less its overlap with the union of the work (``exposed_stream``: every kernel,
  memcpy and memset: a copy on the compute stream is work it does, not a wait; ``exposed``: compute kernels
  only, the offline trace analyzers' rule).  Collectives that overlap each other are counted once (their union).
- **Queued gaps.** Between two kernels queued back to back the compute stream idles ~2 µs (the device's own
  launch latency).  The strict rule counts a collective's time in those gaps as exposed: beside each hidden
  all-reduce of a GPT-2-sized backward ~15 µs, and beside a collective that spins through a whole backward
  (waiting for a late rank) every gap of it, ~1.2 ms in 30 ms.  Those gaps are there with or without the
  collective, and no wait on the compute stream holds them: ``exposed_queued`` fills the work's gaps of at most
  QUEUED_GAP_US before taking the collectives out.  Both are reported.
- **Steps** are cut at marker kernels (``marker``, launched at each iteration's start on the compute stream):
  step *i* is ``[marker_i, marker_{i+1})``, the last one ends at the last activity; every interval is clipped
  to the step it falls in.
- **Blocked rule** (:func:`per_step_blocked`). When the host paces the step (FSDP2's Python per group), the
  compute stream idles beside a running collective because nothing is queued on it yet: the union rule, queued or
  not, counts that time, though the stream waits for the host, not for the collective.  The blocked rule keeps,
  of the queued rule's exposed time, only what falls where the compute stream is *blocked*: in each gap between
  its activities, from the host's launch of the activity that ends the gap (its runtime call, ``cudaLaunchKernel``,
  ``cuLaunchKernel``, ``cudaMemcpyAsync`` and the like, matched by the profiler's correlation id) to the gap's
  end; before that launch the stream had nothing queued.  The compute stream is the markers' stream.  The
  launches come from the same ``prof.events()`` (:func:`launch_times`): the profiler's CUDA activity alone
  records the runtime and driver calls (torch 2.11: CPU-side events whose ``FunctionEvent.id`` is CUPTI's
  correlation id, the same as their kernel's; a kernel's ``device_resource_id`` is its stream).  A launch is
  taken at the call's end, and its latency after it (below): under the profiler a call lasts 5-70 µs, so the
  call's start would count as blocked the host's own time in the call.
  A stream can also be blocked with no kernel queued: a wait on a collective's event (``cudaStreamWaitEvent``)
  queued while the host has yet to launch what follows.  Where the profile holds CUPTI's synchronization records
  (torch's experimental ``enable_cuda_sync_events``: a ``Stream Wait Event`` on the waiting stream, at the host's
  call), ``waited`` gives the rule with such a wait counted as queued work too.
- **Launch latency.** A kernel launched on an idle stream starts ~2 µs after the host's call returns (2 x H200,
  CUDA 13: median 1.7-2.0 µs, p90 2.0-2.4, with a collective running meanwhile or not; ``nccl_latency.py`` over
  ``comm_nccl.py --dump``, ``results/nccl_launch_latency_h200x2.txt``): the device's own launch latency.  A
  host-paced backward beside a collective that spins through it (a rank waiting for its peer) has ~300-1100 such
  launches a step, 1.0-2.4 ms a step that the rule would count as blocked with the window opened at the call's end;
  its DDP span holds none of it.  So a launch opens its window LAUNCH_LATENCY_US after the call's end (the queued
  gaps' bound, the same latency between two queued
  kernels): :func:`per_step_blocked`'s ``latency``.
- **The stream's own gaps** (:func:`own_gaps`, ``per_step_blocked``'s ``less_own``). Between two queued activities
  the compute stream idles for the device's own time to start what follows, longer between kinds (a memcpy after a
  kernel 4-13 µs on 2 x H200, a kernel after a kernel 1.2-2.6), as long with a collective beside as without; a wait
  for a collective lies before it.  The blocked rule counts that time whole wherever a collective runs beside it
  (FSDP2's copy-out alternates a memcpy and a kernel: ~750 gaps a step on a rank waiting for its all-gathers);
  ``less_own`` takes the last m µs off each such gap, m its transition's median with no collective beside.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from statistics import median
from typing import Any, Iterable, Mapping, Sequence

Interval = tuple[float, float, str, str]  # start µs, end µs, name, kind ("kernel", "memcpy", "memset", "annotation")
#: An interval with where it ran and what launched it: start µs, end µs, name, kind, stream, correlation id.
Activity = tuple[float, float, str, str, int, int]
#: A marker kernel lasts at most this long (longer spins are not markers).
MARKER_MAX_US = 10.0
#: Two copies this close follow each other on a queued stream (a launch's gap on the device is ~1.3 µs).
QUEUED_GAP_US = 3.0
#: A kernel launched on an idle stream starts within this of the host's call's end: the device's own launch latency
#: (the blocked rule opens a launch's window this late).
LAUNCH_LATENCY_US = QUEUED_GAP_US
ANNOTATION_PREFIXES = ("nccl:", "fsdp::", "fsdp:", "record_param_comms", "profilerstep", "ddp::")
#: CUPTI's synchronization records (``enable_cuda_sync_events``): no device work, the host's call on a stream.
SYNC_NAMES = ("Stream Wait Event", "Event Sync", "Stream Sync", "Context Sync")


def device_intervals(events: Iterable[Any]) -> list[Interval]:
    """The device's activities in ``prof.events()``: kernels, memcpy and memset, never annotations nor
    synchronization records."""
    return [a[:4] for a in device_activities(events) if a[3] != "sync"]


def device_activities(events: Iterable[Any]) -> list[Activity]:
    """:func:`device_intervals` with each activity's stream (``device_resource_id``) and correlation id (``id``:
    CUPTI's, shared with the runtime call that launched it), and the synchronization records (kind ``"sync"``)."""
    import torch

    out: list[Activity] = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        name = e.name
        low = name.lower()
        activity = getattr(e, "activity_type", None)
        if getattr(e, "is_user_annotation", False) or (activity is not None and "annotation" in str(activity).lower()) \
                or low.startswith(ANNOTATION_PREFIXES):
            kind = "annotation"
        elif name in SYNC_NAMES:
            kind = "sync"
        elif "memcpy" in low:
            kind = "memcpy"
        elif "memset" in low:
            kind = "memset"
        else:
            kind = "kernel"
        out.append((float(e.time_range.start), float(e.time_range.end), name, kind,
                    int(getattr(e, "device_resource_id", -1)), int(e.id)))
    return out


#: The host's calls that queue device work: the CUDA runtime's and driver's (``cudaLaunchKernel``,
#: ``cuLaunchKernel``, ``cuLaunchKernelEx``, ``cudaMemcpyAsync``, ``cudaMemsetAsync``, ``cudaGraphLaunch``...).
LAUNCH_PREFIXES = ("cu",)


def launch_times(events: Iterable[Any], at: str = "end") -> dict[int, float]:
    """The host time (µs) of each runtime or driver call in ``prof.events()``, by correlation id: the call's end
    (``at="end"``: the work is queued by then; an idle stream starts it ~1 µs later) or its start (``"start"``).
    Only CPU-side events named ``cuda*``/``cu*`` count (an op's own id is from another counter)."""
    import torch

    out: dict[int, float] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith(LAUNCH_PREFIXES):
            continue
        out[int(e.id)] = float(e.time_range.end if at == "end" else e.time_range.start)
    return out


def _union(spans: Iterable[tuple[float, float]], bridge: float = 0.0) -> list[list[float]]:
    """The union of ``spans``; gaps of at most ``bridge`` µs between them are filled."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1] + bridge:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _overlap(a: float, b: float, merged: list[list[float]]) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in merged if lo < b and hi > a)


def exposed_us(comm: Sequence[tuple[float, float]], work: Sequence[tuple[float, float]], bridge: float = 0.0) -> float:
    """µs of the union of ``comm`` outside the union of ``work`` (its gaps of at most ``bridge`` µs filled)."""
    busy = _union(work, bridge)
    return sum((b - a) - _overlap(a, b, busy) for a, b in _union(comm))


def back_to_back_us(spans: Iterable[tuple[float, float]]) -> float:
    """µs of ``spans`` (copies) as a queued stream runs them: their union, and each gap of at most QUEUED_GAP_US
    between one and the next (a queued launch's gap, not the host's)."""
    merged = _union(spans)
    return sum(b - a for a, b in merged) + sum(a2 - b1 for (_, b1), (a2, _) in zip(merged, merged[1:])
                                               if a2 - b1 <= QUEUED_GAP_US)


def queued_share(spans: Iterable[tuple[float, float]]) -> float | None:
    """The share of ``spans``' (copies') gaps, one to the next, of at most QUEUED_GAP_US: 1.0 where every copy ran
    queued behind the one before (None: fewer than two)."""
    merged = _union(spans)
    gaps = [a2 - b1 for (_, b1), (a2, _) in zip(merged, merged[1:])]
    return sum(g <= QUEUED_GAP_US for g in gaps) / len(gaps) if gaps else None


def _clip(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]


def per_step(intervals: Sequence[Interval], comm: Sequence[str] = ("nccl",), marker: str = "spin_kernel",
             copy_names: Sequence[str] = ("DtoD",)) -> list[dict[str, float]]:
    """Per step (cut at the ``marker`` kernels; the time before the first marker is no step): ``exposed_stream``,
    ``exposed_queued`` (the same, the work's gaps of at most QUEUED_GAP_US filled), ``exposed`` (analyzers' rule), ``comm`` (the collectives' union), ``copies`` (the activities whose name holds
    one of ``copy_names``: device-to-device memcpy, DDP's copies into ``.grad``: their own time) and
    ``copies_run`` (the same back to back: each copy with the gap before it when it follows another copy within
    QUEUED_GAP_US, as a queued stream runs them), in ms; ``copies_queued``, the share of the copies' gaps that
    are a queued stream's (:func:`queued_share`)."""
    acts = [iv for iv in intervals if iv[3] != "annotation"]
    is_comm = [any(c in n.lower() for c in comm) for _, _, n, _ in acts]
    # a marker is short (a spin of 100 cycles); a longer spin is work
    starts = sorted(a for a, b, n, k in acts if k == "kernel" and marker in n and b - a <= MARKER_MAX_US)
    if not starts:
        return []
    end = max(b for _, b, _, _ in acts)
    bounds = list(zip(starts, [*starts[1:], end]))
    comm_iv = [(a, b) for (a, b, _, _), c in zip(acts, is_comm) if c]
    work_all = [(a, b) for (a, b, n, _), c in zip(acts, is_comm) if not c and not (marker in n and b - a <= MARKER_MAX_US)]
    work_compute = [(a, b) for (a, b, n, k), c in zip(acts, is_comm)
                    if not c and k == "kernel" and not (marker in n and b - a <= MARKER_MAX_US)]
    copies = [(a, b) for (a, b, n, k), c in zip(acts, is_comm) if not c and any(x in n for x in copy_names)]
    rows = []
    for lo, hi in bounds:
        mine = _clip(copies, lo, hi)
        cm = _clip(comm_iv, lo, hi)
        work = _clip(work_all, lo, hi)
        rows.append(dict(
            exposed_stream=exposed_us(cm, work) / 1e3,
            exposed_queued=exposed_us(cm, work, QUEUED_GAP_US) / 1e3,
            exposed=exposed_us(cm, _clip(work_compute, lo, hi)) / 1e3,
            comm=sum(b - a for a, b in _union(cm)) / 1e3,
            copies=sum(b - a for a, b in mine) / 1e3,
            copies_run=back_to_back_us(mine) / 1e3,
            copies_queued=queued_share(mine),
            span=(hi - lo) / 1e3,
        ))
    return rows


def _is_marker(iv: Sequence[Any], marker: str) -> bool:
    return iv[3] == "kernel" and marker in iv[2] and iv[1] - iv[0] <= MARKER_MAX_US


def blocked_windows(activities: Sequence[Activity], launches: Mapping[int, float], stream: int,
                    comm: Sequence[str] = ("nccl",), waits: Sequence[float] = (), latency: float = LAUNCH_LATENCY_US
                    ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Where ``stream`` (the compute stream) waits with work queued: for each gap between its activities (kernels,
    memcpy and memset, markers too; not annotations, not communication), from the later of the gap's start and
    the host's launch of the activity that ends the gap (``launches``: correlation id -> µs) plus ``latency`` (the
    device's own launch latency) to the gap's end;
    with ``waits`` (host times of the stream's own waits on events), from the first wait queued after the launch
    of the activity before the gap, where that comes sooner (a wait's time as recorded, no latency added).  Second, the gaps whose ending activity has no launch
    in ``launches``: each is among the first as a whole (it counts as the union rule counts it)."""
    own = sorted((a, b, corr) for a, b, n, k, s, corr in activities
                 if s == stream and k not in ("annotation", "sync") and not any(c in n.lower() for c in comm))
    waits = sorted(waits)
    windows: list[tuple[float, float]] = []
    unmatched: list[tuple[float, float]] = []
    end: float | None = None
    before: float | None = None  # the launch of the activity before the gap
    for a, b, corr in own:
        if end is not None and a > end:
            launch = launches.get(corr)
            if launch is None:
                unmatched.append((end, a))
                windows.append((end, a))
            else:
                launch += latency
                i = bisect_left(waits, end if before is None else before)
                if i < len(waits):
                    launch = min(launch, waits[i])
                if launch < a:
                    windows.append((max(end, launch), a))
        end = b if end is None else max(end, b)
        before = launches.get(corr, before)
    return windows, unmatched


def within(value: float, truth: float) -> bool:
    """Whether ``value`` lies within 0.1 ms or 2% of ``truth`` (ms): issue 47's bound on a step's wait."""
    return abs(value - truth) <= max(0.1, 0.02 * truth)


def _kind(activity: Activity) -> str:
    return "memcpy" if activity[3] == "memcpy" else "memset" if activity[3] == "memset" else "kernel"


Gap = tuple[float, float, tuple[str, str], bool]  # start µs, end µs, (kind before, kind after), a collective beside


def queued_gaps(activities: Sequence[Activity], launches: Mapping[int, float], stream: int,
                comm: Sequence[str] = ("nccl",), latency: float = LAUNCH_LATENCY_US) -> list[Gap]:
    """The compute stream's gaps between two activities that were both queued (the later launched ``latency`` µs or
    more before the earlier ended), each with its transition (the kinds either side: kernel, memcpy, memset) and
    whether a collective ran in it."""
    own = sorted(a for a in activities
                 if a[4] == stream and a[3] not in ("annotation", "sync") and not any(c in a[2].lower() for c in comm))
    comm_iv = _union((a[0], a[1]) for a in activities
                     if a[3] not in ("annotation", "sync") and any(c in a[2].lower() for c in comm))
    gaps: list[Gap] = []
    end: float | None = None
    prev: Activity | None = None
    for act in own:
        a, b = act[0], act[1]
        if end is not None and prev is not None and a > end:
            launch = launches.get(act[5])
            if launch is not None and launch + latency <= end:
                gaps.append((end, a, (_kind(prev), _kind(act)), _overlap(end, a, comm_iv) > 0))
        if end is None or b > end:
            end, prev = b, act
    return gaps


def own_gap_medians(gaps: Sequence[Gap]) -> dict[tuple[str, str], float]:
    """Each transition's median gap with no collective beside (µs): the device's own time to start what follows."""
    alone: dict[tuple[str, str], list[float]] = {}
    for lo, hi, move, beside in gaps:
        if not beside:
            alone.setdefault(move, []).append(hi - lo)
    return {move: median(v) for move, v in alone.items()}


def own_gaps(activities: Sequence[Activity], launches: Mapping[int, float], stream: int,
             comm: Sequence[str] = ("nccl",), latency: float = LAUNCH_LATENCY_US) -> list[tuple[float, float]]:
    """The device's own part of each queued gap with a collective beside: its last ``m`` µs, where ``m`` is the
    gap's transition's median with no collective beside (:func:`own_gap_medians`), the whole gap where it is no
    longer.  Between two queued activities of different kinds the stream idles longer than between two kernels (2 x
    H200: a memcpy starts ~12 µs after a kernel, a kernel ~4 µs after a memcpy, a kernel ~2 µs after a kernel, as
    long with a collective beside as without): that time is there without the collective, and no wait holds it.
    A wait for the collective lies before it (the stream resumes, then starts what follows): the rest of the gap
    stays.  Gaps of a transition never seen without a collective keep all of it."""
    gaps = queued_gaps(activities, launches, stream, comm, latency)
    own = own_gap_medians(gaps)
    return [(max(lo, hi - own[move]), hi) for lo, hi, move, beside in gaps if beside and move in own]


def compute_stream(activities: Sequence[Activity], marker: str = "spin_kernel") -> int | None:
    """The stream the most ``marker`` kernels run on (the markers are launched on the compute stream); None
    without markers."""
    streams = Counter(a[4] for a in activities if _is_marker(a, marker))
    return streams.most_common(1)[0][0] if streams else None


def step_exposed(acts: Sequence[Activity], comm: Sequence[str] = ("nccl",), marker: str = "spin_kernel"
                 ) -> list[tuple[float, float, list[tuple[float, float]]]]:
    """Each step (cut at the markers, as :func:`per_step` cuts them) as ``(start, end, exposed)``: the queued rule's
    exposed communication in it, the collectives' union outside every other activity (``acts``: no annotations,
    no sync records), the work's gaps of at most QUEUED_GAP_US filled."""
    starts = sorted(a[0] for a in acts if _is_marker(a, marker))
    if not starts:
        return []
    last = max(a[1] for a in acts)
    is_comm = [any(c in a[2].lower() for c in comm) for a in acts]
    comm_iv = [(a[0], a[1]) for a, c in zip(acts, is_comm) if c]
    work = [(a[0], a[1]) for a, c in zip(acts, is_comm) if not c and not _is_marker(a, marker)]
    return [(lo, hi, _minus(_union(_clip(comm_iv, lo, hi)), _union(_clip(work, lo, hi), QUEUED_GAP_US)))
            for lo, hi in zip(starts, [*starts[1:], last])]


def per_step_blocked(activities: Sequence[Activity], launches: Mapping[int, float], comm: Sequence[str] = ("nccl",),
                     marker: str = "spin_kernel", latency: float = LAUNCH_LATENCY_US) -> list[dict[str, float]]:
    """The blocked rule per step (cut as :func:`per_step` cuts them): ``blocked``, the queued rule's exposed
    communication (the collectives' union outside every other activity, the work's gaps of at most QUEUED_GAP_US
    filled) inside the compute stream's :func:`blocked_windows`; ``unmatched``, the part of it in gaps whose
    ending activity has no launch in ``launches`` (counted in ``blocked``); ``queued``, the queued rule itself
    (``per_step``'s ``exposed_queued``); and where ``activities`` hold the compute stream's ``Stream Wait Event``
    records, ``waited``, the blocked rule with each of those waits counted as queued work (its record's end); in
    ms.  Each launch opens its window ``latency`` µs after its call's end (the device's launch latency, the module's
    text); a wait's record is not moved (it holds the stream from its call on)."""
    acts = [a for a in activities if a[3] not in ("annotation", "sync")]
    stream = compute_stream(acts, marker)
    if stream is None:
        return []
    windows, unmatched = blocked_windows(acts, launches, stream, comm, latency=latency)
    waits = [a[1] for a in activities if a[3] == "sync" and a[2] == "Stream Wait Event" and a[4] == stream]
    waited = blocked_windows(acts, launches, stream, comm, waits, latency)[0] if waits else None
    gaps = own_gaps(acts, launches, stream, comm, latency)
    rows = []
    for lo, hi, exposed in step_exposed(acts, comm, marker):
        blocked = _union(_clip(windows, lo, hi))
        lost = _union(_clip(unmatched, lo, hi))
        row = dict(
            blocked=sum(_overlap(a, b, blocked) for a, b in exposed) / 1e3,
            unmatched=sum(_overlap(a, b, lost) for a, b in exposed) / 1e3,
            queued=sum(b - a for a, b in exposed) / 1e3,
        )
        kept = _union(_minus(blocked, _union(_clip(gaps, lo, hi))))
        row["less_own"] = sum(_overlap(a, b, kept) for a, b in exposed) / 1e3
        if waited is not None:
            held = _union(_clip(waited, lo, hi))
            row["waited"] = sum(_overlap(a, b, held) for a, b in exposed) / 1e3
        rows.append(row)
    return rows




#: An exposed interval after which the device idles longer than this had no work queued behind it.
IDLE_AFTER_US = 10.0


def _minus(spans: list[list[float]], busy: list[list[float]]) -> list[tuple[float, float]]:
    """The parts of ``spans`` (a union) outside ``busy`` (a union)."""
    out: list[tuple[float, float]] = []
    for a, b in spans:
        at = a
        for lo, hi in busy:
            if hi <= at or lo >= b:
                continue
            if lo > at:
                out.append((at, lo))
            at = max(at, hi)
            if at >= b:
                break
        if at < b:
            out.append((at, b))
    return out


#: :func:`exposed_where` names this many of a step's longest exposed intervals outside the spans.
TOP = 3
#: The step's phases in their order on the compute stream from its marker (the plain loop's: the batch is on the
#: device when the marker is launched), as phase-timer's per-step rows name them; the time after the optimizer, to
#: the next step's marker, is ``between`` (``between_steps`` and the next batch's ``h2d``).
STEP_ORDER = ("forward", "backward", "optimizer")


def _cuts(lo: float, hi: float, spans: list[list[float]], ms: Mapping[str, float] | None) -> list[tuple[float, str]]:
    """A step's phases as ``(end µs, name)`` in order, the last ending at ``hi``: from phase-timer's per-step ``ms``
    (each of STEP_ORDER's device ms, laid end to end from the step's marker at ``lo``; phase-timer's marks are
    contiguous, so each boundary is its mark, within the µs between the forward's mark and the marker), else
    from the step's spans alone (``before spans``, ``among spans``, ``after spans``; ``no span`` in a step with
    none)."""
    if ms and all(ms.get(p) is not None for p in STEP_ORDER):
        cuts, at = [], lo
        for p in STEP_ORDER:
            at += ms[p] * 1e3
            cuts.append((min(at, hi), p))
        return [*cuts, (hi, "between")]
    mine = [(a, b) for a, b in spans if a < hi and b > lo]
    if not mine:
        return [(hi, "no span")]
    return [(max(lo, mine[0][0]), "before spans"), (min(hi, mine[-1][1]), "among spans"), (hi, "after spans")]


def _phase_at(t: float, cuts: list[tuple[float, str]]) -> str:
    return next((name for end, name in cuts if t < end), cuts[-1][1])


def _by_phase(spans: Iterable[tuple[float, float]], lo: float, cuts: list[tuple[float, str]]) -> dict[str, float]:
    """ms of ``spans`` in each of the step's phases (a span across a boundary split there)."""
    out: dict[str, float] = {}
    for a, b in spans:
        start = lo
        for end, name in cuts:
            part = min(b, end) - max(a, start)
            if part > 0:
                out[name] = out.get(name, 0.0) + part / 1e3
            start = end
    return out


def exposed_where(intervals: Sequence[Interval], begin: str, end: str, comm: Sequence[str] = ("nccl",),
                  marker: str = "spin_kernel", phases: Sequence[Mapping[str, float] | None] | None = None
                  ) -> list[dict[str, Any]]:
    """A diagnosis, per step: the queued rule's exposed communication inside the spans a timer marked with a
    ``begin`` kernel and an ``end`` kernel (its waits: each from a begin kernel's end to the next end kernel's
    start), and outside them, by collective (``AllGather``, ``ReduceScatter``, ``AllReduce``), and how much of it
    the device then stays idle after (``then_idle``: the next work starts more than IDLE_AFTER_US after the
    interval ends: no stream was waiting to run at the collective's end, the host had not queued the work yet).

    Where the outside part lies: ``by_phase``, its ms in each of the step's phases (``phases``: phase-timer's
    per-step rows, the k-th for the k-th step, each phase's device ms; without them, before, among and after the
    step's spans: :func:`_cuts`), and ``top``, its TOP longest intervals, each ``(ms, phase at its middle, the
    work that ends last before it, the work that starts first after it)``; ``longest``, the first of them without
    its phase.  In ms."""
    acts = [iv for iv in intervals if iv[3] != "annotation"]
    is_marker = [k == "kernel" and marker in n and b - a <= MARKER_MAX_US for a, b, n, k in acts]
    starts = sorted(a for (a, _, _, _), m in zip(acts, is_marker) if m)
    if not starts:
        return []
    last = max(b for _, b, _, _ in acts)
    is_comm = [any(c in n.lower() for c in comm) for _, _, n, _ in acts]
    work = sorted((a, b, n) for (a, b, n, _), c, m in zip(acts, is_comm, is_marker) if not c and not m)
    opens = sorted(b for a, b, n, k in acts if begin in n)
    closes = sorted(a for a, b, n, k in acts if end in n)
    spans, j = [], 0
    for o in opens:  # each begin's end to the first end kernel's start after it
        while j < len(closes) and closes[j] < o:
            j += 1
        if j < len(closes):
            spans.append([o, closes[j]])
    spans = _union(spans)
    rows = []
    for i, (lo, hi) in enumerate(zip(starts, [*starts[1:], last])):
        cm = _clip([(a, b) for (a, b, _, _), c in zip(acts, is_comm) if c], lo, hi)
        busy = _union(_clip([(a, b) for a, b, _ in work], lo, hi), QUEUED_GAP_US)
        exposed = _minus(_union(cm), busy)
        inside = sum(_overlap(a, b, spans) for a, b in exposed)
        outside = [(a, b) for a, b in _minus([list(e) for e in exposed], spans)]
        cuts = _cuts(lo, hi, spans, phases[i] if phases is not None and i < len(phases) else None)
        kinds: dict[str, float] = {}
        idle = 0.0
        for a, b in outside:
            nxt = next((w[0] for w in work if w[0] >= b - 0.01), None)
            if nxt is None or nxt - b > IDLE_AFTER_US:
                idle += b - a
            for (ca, cb, cn, _), c in zip(acts, is_comm):
                if c and ca < b and cb > a:
                    kind = next((k for k in ("AllGather", "ReduceScatter", "AllReduce") if k in cn), "other")
                    kinds[kind] = kinds.get(kind, 0.0) + (min(b, cb) - max(a, ca)) / 1e3
                    break
        top = []
        for a, b in sorted(outside, key=lambda iv: iv[0] - iv[1])[:TOP]:
            before = max((w for w in work if w[1] <= a + 0.01), key=lambda w: w[1], default=None)
            after = min((w for w in work if w[0] >= b - 0.01), key=lambda w: w[0], default=None)
            top.append((round((b - a) / 1e3, 3), _phase_at((a + b) / 2, cuts), before[2][:60] if before else None,
                        after[2][:60] if after else None))
        rows.append(dict(inside=inside / 1e3, outside=sum(b - a for a, b in outside) / 1e3, kinds=kinds,
                         then_idle=idle / 1e3, by_phase=_by_phase(outside, lo, cuts), top=top,
                         longest=(top[0][0], *top[0][2:]) if top else None, n_outside=len(outside)))
    return rows
