"""The exchange between ranks at scale, no GPU needed: real processes up to 32, simulated ranks up to 16k.

    PYTHONPATH=. python benchmarks/rank_exchange.py [--ranks 2,8,16,32] [--scale 64,...,16384] [--out FILE]

**Real processes** (``--ranks``). Each of N processes (forked) joins a real TCPStore, the way
``init_process_group`` gives every job one, and a real gloo default process group over it
(``--backend fake``: a group that makes no connections, the store alone). Then each process
makes phase-timer's exchange (``RankExchange.create()``) and runs ``--windows`` windows of 50 ms,
calling ``add`` and ``exchange`` as the core does. Rank N−1 is the slowest in ``forward``. Per N,
it prints:

* set-up: ``create()`` on each rank (median, max), against the previous release's design, a gloo
  group over all ranks (``new_group``, a full mesh), made afterwards in the same processes;
* per window: host time on the training thread inside ``exchange()`` (median over windows;
  rank 0, and the median of the others), and on the exchange's own thread: store requests and
  their time, for a rank that leads no group, for a group's leader, and for rank 0;
* whether rank 0 wrote every window with every rank, and named rank N−1 slowest;
* with ``--kill``: rank 1 vanishes (``os._exit``) after 2 windows, with no final report; the
  others must finish, and rank 0 must name it gone (here after 8 exchanges and 0.5 s of silence;
  in a real run ``STALE_S`` is 30 s), and write every window with the rest.  With ``--fan-in 2``
  rank 1 leads a group (ranks 0 and 1), so its group must be read on by the leader above it.

**Simulated ranks** (``--scale``), in this one process, over a real store (``--store tcp``: a
TCPStore server and its clients, as a job has): each simulated rank appends its window (8 phases,
its memory, its counts) and its run totals to its group's key as its exchange thread would; then
each group's leader reads and sends up (``RankExchange._lead``), lowest level first, and rank 0
reads the root (``_read_root``) and does what its training thread does with each window (the
straggler signals, the scalars, the job's rates).  Each is timed apart: per N, rank 0's time per
window (its thread's part in brackets), its requests and the bytes it fetched, and a level-1
leader's time.  The same N against the design before the tree (``--old-rev``, loaded from git:
every rank appends to one key, rank 0 reads and folds in every report).  Each run checks that
every window holds every rank, names rank N−1 slowest, and has the median across ranks within 0.5%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import phase_timer.distributed.rank_reader as reader_module  # noqa: E402
import phase_timer.distributed.ranks as ranks_module  # noqa: E402
from benchmarks.provenance import ROOT, code_line  # noqa: E402
from phase_timer.distributed.rank_tree import FAN_IN  # noqa: E402
from phase_timer.distributed.ranks import RankExchange  # noqa: E402

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "between_steps", "step", "period")


class TimedStore:
    """The exchange's store connection, counting its requests and their time."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.requests = 0
        self.ns = 0
        self.slow: list[tuple[str, float, float]] = []  # (request, when, ms) of those over 100 ms

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                took = time.perf_counter_ns() - t0
                self.ns += took
                self.requests += 1
                if took > 100e6:
                    self.slow.append((name, t0 / 1e9, took / 1e6))

        return timed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, n: int, port: int, windows: int, period_s: float, kill: bool, backend: str, results: Any,
           fan_in: int | None = None) -> None:
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers "fake"

    if kill:  # a run of seconds: a rank silent for 8 exchanges and 0.5 s is gone (a real run: 30 s)
        reader_module.STALE_S = 0.5
    if fan_in is not None:  # a small tree over few processes: leaders, and (--kill) a dead one
        ranks_module.FAN_IN = fan_in

    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(backend, rank=rank, world_size=n, store=store)
    # The fake group's init has no barrier: without one, ranks would start while others still
    # connect (seen: a 5 s stall of the job's first requests at 32 ranks), which a real job's init forbids.
    store.add("bench/ready", 1)
    while int(store.add("bench/ready", 0)) < n:
        time.sleep(0.005)
    t0 = time.perf_counter_ns()
    ex = RankExchange.create()
    setup_ms = (time.perf_counter_ns() - t0) / 1e6
    assert ex is not None
    leads = bool(ex._nodes)
    ex.store = timed = TimedStore(ex.store)  # the thread and the nodes it reads use it from now on
    exchange_us, written = [], []
    for w in range(windows):
        time.sleep(period_s)  # the window's steps
        if kill and rank == 1 and w == 2:
            os._exit(0)  # vanishes: no final report, no goodbye
        forward = 1.0 + 0.5 * rank / n
        ex.add(w, 50 * w + 49, 50, {p: [forward if p == "forward" else 2.0] * 50 for p in PHASES})
        t = time.perf_counter_ns()
        written += ex.exchange()
        exchange_us.append((time.perf_counter_ns() - t) / 1e3)
    t = time.perf_counter_ns()
    written += ex.finish(timeout_s=20.0)
    finish_ms = (time.perf_counter_ns() - t) / 1e6
    sent = len(ex._outbox) if rank else 0  # nothing left unsent
    out: dict[str, Any] = {
        "rank": rank, "leads": leads, "setup_ms": setup_ms, "exchange_us": statistics.median(exchange_us), "finish_ms": finish_ms,
        "requests": timed.requests, "store_ms": timed.ns / 1e6, "unsent": sent, "slow_requests": timed.slow,
        "error": None if ex._error is None else f"{type(ex._error).__name__}: {ex._error}",
    }
    if rank == 0:
        out["windows"] = [[w.key, w.ranks, w.stats("forward")["slowest_rank"]] for w in written]
        out["gone"] = sorted(ex.gone)
    gloo_ms = None
    if not kill:  # the previous release's set-up: a gloo group over all ranks
        t = time.perf_counter_ns()
        dist.new_group(backend="gloo")
        gloo_ms = (time.perf_counter_ns() - t) / 1e6
    out["gloo_group_ms"] = gloo_ms
    results.put(out)
    # A job ends together: without this, a rank done with new_group exits while a peer still
    # connects its mesh ("Connection closed by peer", seen at 32 ranks on 2 cores).
    store.add("bench/done", 1)
    while int(store.add("bench/done", 0)) < n - (1 if kill else 0):
        time.sleep(0.005)
    dist.destroy_process_group()


def run(n: int, windows: int, period_s: float, kill: bool, backend: str, timeout_s: float,
        fan_in: int | None = None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    t0 = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, n, port, windows, period_s, kill, backend, results, fan_in)) for r in range(n)]
    for p in procs:
        p.start()
    got = []
    expected = n - 1 if kill else n
    while len(got) < expected and time.monotonic() - t0 < timeout_s:
        try:
            got.append(results.get(timeout=1))
        except Exception:  # noqa: BLE001 - the queue's Empty: keep waiting until the limit
            continue
    for p in procs:
        p.join(max(0.1, timeout_s - (time.monotonic() - t0)))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    return {"n": n, "ranks": sorted(got, key=lambda r: r["rank"]), "wall_s": time.monotonic() - t0, "hung": len(hung)}


def summarize(res: dict[str, Any], windows: int, kill: bool) -> tuple[str, bool]:
    """The line for one N, and whether every check held."""
    n, ranks = res["n"], res["ranks"]
    zero = next((r for r in ranks if r["rank"] == 0), None)
    others = [r for r in ranks if r["rank"] != 0 and not r.get("leads")]  # the ranks that lead no group
    leaders = [r for r in ranks if r["rank"] != 0 and r.get("leads")]
    if zero is None:
        return f"{n:4d} ranks: rank 0 did not report (hung {res['hung']})", False
    wins = zero["windows"]
    want_ranks = n - 1 if kill else n
    complete = all(r == want_ranks for _, r, _ in wins[2:]) and len(wins) == windows
    slowest_ok = all(int(s) == n - 1 for _, _, s in wins)
    setup = [r["setup_ms"] for r in ranks]
    gloo = [r["gloo_group_ms"] for r in ranks if r["gloo_group_ms"] is not None]
    per_rank_req = statistics.median(r["requests"] / (windows + 1) for r in others) if others else 0
    per_rank_ms = statistics.median(r["store_ms"] / (windows + 1) for r in others) if others else 0
    line = (
        f"{n:4d} ranks: set-up median {statistics.median(setup):6.2f} ms max {max(setup):6.2f} ms"
        + (f" | gloo group (previous) median {statistics.median(gloo):8.1f} ms max {max(gloo):8.1f} ms" if gloo else "")
        + f" | exchange() on the training thread: rank 0 {zero['exchange_us']:5.1f} us, others "
        + (f"{statistics.median(r['exchange_us'] for r in ranks if r['rank']):5.1f} us" if len(ranks) > 1 else "-")
        + f" | per window: a rank {per_rank_req:.1f} requests {per_rank_ms:.2f} ms; "
        + (f"a leader {statistics.median(r['requests'] / (windows + 1) for r in leaders):.1f} requests "
           f"{statistics.median(r['store_ms'] / (windows + 1) for r in leaders):.2f} ms; " if leaders else "")
        + "rank 0 "
        + f"{zero['requests'] / (windows + 1):.1f} requests {zero['store_ms'] / (windows + 1):.2f} ms"
        + f" | windows {len(wins)}/{windows} with {want_ranks} ranks: {'yes' if complete else 'NO'}"
        + f" | slowest named: {'rank %d' % (n - 1) if slowest_ok else 'WRONG'}"
        + (f" | killed rank 1: gone={zero['gone']} finish {zero['finish_ms']:.0f} ms" if kill else "")
        + f" | wall {res['wall_s']:.1f} s, hung {res['hung']}"
    )
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if r["error"]]
    if errors:
        line += " | errors: " + "; ".join(errors)
    ok = complete and slowest_ok and not res["hung"] and not errors and len(ranks) == want_ranks
    ok = ok and (zero["gone"] == [1] if kill else not zero["gone"])
    return line, ok


def frame_bytes() -> int:
    """What a rank sends for one window of these phases (its report and its run totals, in one frame)."""
    from phase_timer.distributed.rank_node import leaf_body
    from phase_timer.distributed.ranks import _json, _OwnTotals, encode

    own = _OwnTotals()
    sums = {p: [123.456789, 50] for p in PHASES}
    own.add(50, sums, None, None)
    return len(encode(3, leaf_body([_json([7, 399, 50, sums])], own.as_json())))


# -- rank zero at scale, in one process: N simulated ranks over a real store -----------------------
class CountingStore:
    """A store connection that counts its requests and the bytes its reads fetched."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.requests = 0
        self.fetched = 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self.requests += 1
            out = fn(*args)
            if name == "get":
                self.fetched += len(out)
            elif name == "multi_get":
                self.fetched += sum(map(len, out))
            return out

        return counted


def _store(kind: str) -> tuple[Any, Any]:
    """(a connection for the simulated ranks, one for rank zero) to a fresh real store."""
    if kind == "hash":
        store = dist.HashStore()
        return store, store
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    return server, server.clone()


def _report(rank: int, n: int, w: int) -> tuple[list[Any], dict[str, list[float]], dict[str, float], dict[str, float]]:
    """Rank ``rank``'s window ``w`` as ``RankExchange.add`` makes it (rank n-1 the slowest in forward), with its
    memory (a CUDA rank) and counts (every rank counts its batches by default)."""
    forward = 1.0 + 0.5 * rank / n
    sums = {p: [50 * (forward if p == "forward" else 2.0), 50] for p in PHASES}
    memory = {"peak_allocated_mb": 1000.0 + rank % 7, "peak_reserved_mb": 1200.0, "device_total_mb": 81559.0,
              "alloc_retries": 0}
    counts = {"samples": 800.0, "period_ms": 50 * 2.0 * len(PHASES), "steps": 50.0}
    return [w, 50 * w + 49, 50, sums, {**memory, "counts": counts}], sums, memory, counts


def _exact_median(n: int) -> float:
    return statistics.median(1.0 + 0.5 * r / n for r in range(n))


class ZeroTimes:
    """Rank zero's cost a window, either design: its thread's read, then its training thread's handling."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.thread_ms: list[float] = []
        self.requests: list[int] = []
        self.bytes: list[int] = []

    def window(self, zero: Any, read: Any, handle: Any) -> None:
        """Time ``read()`` (rank zero's thread) and ``handle()`` (its training thread) for one window."""
        req0, bytes0 = zero.store.requests, zero.store.fetched
        t = time.perf_counter_ns()
        read()
        t_thread = time.perf_counter_ns()
        handle()
        end = time.perf_counter_ns()
        self.ms.append((end - t) / 1e6)
        self.thread_ms.append((t_thread - t) / 1e6)
        self.requests.append(zero.store.requests - req0)
        self.bytes.append(zero.store.fetched - bytes0)

    def medians(self, steady: slice) -> dict[str, float]:
        return {"rank0_ms": statistics.median(self.ms[steady]), "rank0_thread_ms": statistics.median(self.thread_ms[steady]),
                "rank0_requests": statistics.median(self.requests[steady]),
                "rank0_kb": statistics.median(self.bytes[steady]) / 1e3}


def scale_new(n: int, fan_in: int, windows: int, kind: str) -> dict[str, Any]:
    """The tree: every rank's frame sent as its thread sends it; each leader's reading and sending up, and rank
    zero's, run in turn in this thread (each timed on its own), exchange by exchange."""
    from phase_timer.diagnosis import Signals
    from phase_timer.outputs.tags import rank_scalars
    from phase_timer.distributed.rank_node import leaf_body
    from phase_timer.distributed.rank_tree import Tree
    from phase_timer.distributed.ranks import RankExchange, _json, _OwnTotals, encode

    ns = f"bench/new/{n}"
    ranks_store, zero_store = _store(kind)
    tree = Tree(n, fan_in)
    zero = RankExchange(CountingStore(zero_store), 0, n, ns, fan_in=fan_in)
    leaders: dict[int, Any] = {}  # rank -> its exchange (not rank 0)
    levels: list[list[tuple[Any, Any]]] = [[] for _ in range(tree.depth)]  # level -> (exchange, node) it leads
    for level in range(1, tree.depth):
        span = fan_in**level
        for j in range(-(-n // span)):
            r = tree.leader(tree.node(level, j))
            ex = leaders.get(r) or leaders.setdefault(r, RankExchange(CountingStore(ranks_store), r, n, ns, fan_in=fan_in))
            levels[level].append((ex, next(x for x in ex._nodes if x.node.level == level)))
    own = [_OwnTotals() for _ in range(n)]
    leaf = [f"{ns}/{tree.leaf_node(r).name}" for r in range(n)]
    times, leader_ms, windows_out, signals = ZeroTimes(), [], [], Signals()
    for w in range(windows):
        for r in range(n):  # each rank's thread: one append and one count
            report, sums, memory, counts = _report(r, n, w)
            own[r].add(50, sums, memory, counts)
            ranks_store.append(f"{leaf[r]}/{w}", encode(r, leaf_body([_json(report)], own[r].as_json())))
            ranks_store.add(f"{leaf[r]}/{w}/n", 1)
        for level in range(1, tree.depth):  # the leaders, lowest level first: each its own rank's thread
            for ex, node in levels[level]:
                t = time.perf_counter_ns()
                ex._lead_node(node, w)
                if level == 1:
                    leader_ms.append((w, (time.perf_counter_ns() - t) / 1e6))
        def handle() -> None:
            for win in zero._arrived():  # rank zero's training thread: what the core does with each window
                signals.add_rank_window(win.phases)
                scalars = rank_scalars(win)
                scalars.update({f"throughput/job_{k}": v for k, v in win.job.items()})
                windows_out.append(win)

        times.window(zero, lambda: zero._read_root(w), handle)  # noqa: B023 - called at once, in this iteration
    for ex in [zero, *leaders.values()]:
        ex._todo.put(("stop",))
    steady = slice(2, None)  # the first windows warm the caches
    per_leader = [ms for w, ms in leader_ms if w >= 2]
    median = _exact_median(n)
    ok = (len(windows_out) == windows and all(x.ranks == n for x in windows_out)
          and all(x.stats("forward")["slowest_rank"] == n - 1 for x in windows_out)
          and all(abs(x.stats("forward")["median"] / median - 1) <= 0.005 for x in windows_out)
          and all(abs(x.job["samples_per_s"] - n * 800 / 0.8) < 1e-6 * n * 1000 for x in windows_out))
    return {"n": n, "depth": tree.depth, **times.medians(steady),
            "leader_ms": statistics.median(per_leader) if per_leader else None,
            "leader_max_ms": max(per_leader) if per_leader else None, "leaders": len(leaders) + 1, "ok": ok}


#: The modules the old files import, by their names then, and where each lives today.
_OLD_NAMES = {"cpu_use": "diagnosis.cpu_use", "input_advice": "diagnosis.input_advice", "memory": "phases",
              "stats": "timing.stats", "syncs": "measures.syncs"}


def _old_modules(rev: str) -> Any:
    """``phase_timer/ranks.py``, ``metrics.py`` and ``diagnosis.py`` as they were at ``rev`` (git), loaded beside
    today's (their imports of the rest of the package resolve to today's modules, under the names they had then:
    ``_OLD_NAMES``; ``metrics``, split since into ``phases``, ``tags`` and ``table``, resolves to the old one)."""
    import importlib
    import subprocess
    import types

    for old_name, today in _OLD_NAMES.items():
        sys.modules.setdefault(f"phase_timer.{old_name}", importlib.import_module(f"phase_timer.{today}"))
    mods = {}
    for name in ("metrics", "ranks", "diagnosis"):
        src = subprocess.run(["git", "show", f"{rev}:phase_timer/{name}.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        mod = types.ModuleType(f"old_{name}")
        mod.__file__ = f"{rev}:phase_timer/{name}.py"
        sys.modules[mod.__name__] = mod  # its dataclasses look their module up
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - our own file, from git
        mods[name] = mod
        if name == "metrics":
            sys.modules.setdefault("phase_timer.metrics", mod)
    return types.SimpleNamespace(**mods)


def scale_old(n: int, windows: int, kind: str, old: Any) -> dict[str, Any]:
    """The design before the tree (``old``: its modules): every rank appends to one key, rank zero reads them all."""
    from phase_timer.measures import throughput

    ns = f"bench/old/{n}"
    ranks_store, zero_store = _store(kind)
    zero = old.ranks.RankExchange(CountingStore(zero_store), 0, n, ns)
    signals = old.diagnosis.Signals()
    times, written = ZeroTimes(), []
    for w in range(windows):
        for r in range(1, n):
            report = _report(r, n, w)[0]
            ranks_store.append(f"{ns}/{w}", old.ranks.encode(r, [old.ranks._json(report)]))
            ranks_store.add(f"{ns}/{w}/n", 1)
        report, sums, memory, counts = _report(0, n, w)
        zero.add(w, report[1], 50, {p: [s / c] * c for p, (s, c) in sums.items()}, memory=memory, counts=counts)
        def handle() -> None:
            for win in zero._arrived(final=False):  # its training thread, as the core did
                signals.add_rank_window(win.means)
                scalars = old.metrics.rank_scalars(win)
                scalars.update({f"throughput/job_{k}": v for k, v in throughput.job_rates(win.counts).items()})
                written.append(win)

        times.window(zero, lambda: zero._read_up_to(w), handle)  # noqa: B023 - called at once, in this iteration
    zero._todo.put(("stop",))
    steady = slice(2, None)
    ok = len(written) == windows and all(x.ranks == n for x in written)
    return {"n": n, **times.medians(steady), "ok": ok}


def scale_line(new: dict[str, Any], old: dict[str, Any] | None) -> str:
    n = new["n"]
    line = f"{n:6d} ranks: rank 0 per window "
    if old is not None:
        line += (f"old {old['rank0_ms']:8.2f} ms ({old['rank0_thread_ms']:7.2f} thread; {old['rank0_requests']:.0f} "
                 f"requests, {old['rank0_kb']:7.1f} kB) | ")
    line += (f"new {new['rank0_ms']:6.2f} ms ({new['rank0_thread_ms']:5.2f} thread; {new['rank0_requests']:.0f} requests, "
             f"{new['rank0_kb']:5.1f} kB), depth {new['depth']}, {new['leaders']} leaders")
    if new["leader_ms"] is not None:
        line += f" | a level-1 leader per window median {new['leader_ms']:5.2f} ms, max {new['leader_max_ms']:5.2f} ms"
    line += f" | every window, every rank, slowest and median right: {'yes' if new['ok'] else 'NO'}"
    if old is not None and not old["ok"]:
        line += " (old: NOT every window)"
    return line


#: The code before the tree (rank zero read every rank's report): what ``--old-rev`` names by default.
OLD_REV = "5b5f317"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,8,16,32", help="real processes (empty: none)")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--period", type=float, default=0.05, help="seconds per window")
    ap.add_argument("--kill", action="store_true", help="rank 1 vanishes after 2 windows")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "fake"),
                    help="the job's own process group (fake: no connections, the store alone)")
    ap.add_argument("--fan-in", type=int, default=None, help=f"children per node of the tree (default {FAN_IN})")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--scale", default="64,128,256,512,1024,2048,4096,8192,16384",
                    help="simulated ranks in one process: rank 0's (and a leader's) time per window (empty: none)")
    ap.add_argument("--scale-windows", type=int, default=8)
    ap.add_argument("--store", default="tcp", choices=("tcp", "hash"), help="the store the simulated ranks write to")
    ap.add_argument("--old-rev", default=OLD_REV, help="the commit of the design before the tree (empty: skip it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fan_in = args.fan_in or FAN_IN
    lines = [code_line()]
    results: list[dict[str, Any]] = []
    failed: list[str] = []
    if args.ranks:
        lines.append(
            f"rank exchange through the job's TCPStore ({args.backend} job), {os.cpu_count()} CPU cores, "
            f"{time.strftime('%Y-%m-%d')}; fan-in {fan_in}; {args.windows} windows of {args.period * 1e3:.0f} ms; "
            f"{frame_bytes()} bytes a rank sends per window ({len(PHASES)} phases, no memory, no counts)")
        print(lines[-1], flush=True)
    for n in map(int, filter(None, args.ranks.split(","))):
        res = run(n, args.windows, args.period, args.kill, args.backend, args.timeout, args.fan_in)
        results.append(res)
        line, ok = summarize(res, args.windows, args.kill)
        lines.append(line)
        if not ok:
            failed.append(f"{n} processes")
        print(lines[-1], flush=True)
    old = _old_modules(args.old_rev) if args.old_rev and args.scale else None
    if args.scale:
        lines.append(
            f"rank 0 at scale, in one process ({args.store} store, {args.scale_windows} windows, the median of those "
            f"after the first 2): N simulated ranks each send a window (8 phases, memory, counts) as its thread does; "
            f"each leader's and rank 0's reads run in turn, timed apart. Old: commit {args.old_rev or '-'} "
            f"(one key, rank 0 reads every rank); new: the tree, fan-in {fan_in}. Rank 0's time: its exchange "
            f"thread's reading and merging, and its training thread's taking the windows in and writing their scalars")
        print(lines[-1], flush=True)
    for n in map(int, filter(None, args.scale.split(","))):
        new = scale_new(n, fan_in, args.scale_windows, args.store)
        was = scale_old(n, args.scale_windows, args.store, old) if old is not None else None
        results.append({"scale": new, "old": was})
        lines.append(scale_line(new, was))
        if not new["ok"] or (was is not None and not was["ok"]):
            failed.append(f"{n} simulated")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(results, f)
    if failed:
        sys.exit(f"the exchange failed a check at {failed} (see the lines above)")


if __name__ == "__main__":
    main()
