"""The exchange between ranks at scale: N real processes on this machine, no GPU needed.

    PYTHONPATH=. python benchmarks/rank_exchange.py [--ranks 2,8,16,32] [--windows 20] [--out FILE]

Each of N processes (forked) joins a real TCPStore, the way ``init_process_group``
gives every job one, and a real gloo default process group over it (``--backend fake``:
a group that makes no connections, the store alone). Then each process
makes phase-timer's exchange (``RankExchange.create()``) and runs ``--windows``
windows of 50 ms, calling ``add`` and ``exchange`` as the core does. Rank N−1 is
the slowest in ``forward``. Per N, it prints:

* set-up: ``create()`` on each rank (median, max), against the previous release's
  design, a gloo group over all ranks (``new_group``, a full mesh), made afterwards
  in the same processes;
* per window: host time on the training thread inside ``exchange()`` (median over windows;
  rank 0, which also writes the windows, and the median of the others), and on the
  exchange's own thread: store requests and their time, per rank and for rank 0;
* bytes a rank sends per window;
* whether rank 0 wrote every window with every rank, and named rank N−1 slowest;
* with ``--kill``: rank 1 vanishes (``os._exit``) after 2 windows, with no final report; the
  others must finish, and rank 0 must name it gone (here after 8 exchanges and 0.5 s
  of silence; in a real run ``STALE_S`` is 30 s), and write every window with the rest.
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

import phase_timer.ranks as ranks_module  # noqa: E402
from phase_timer.ranks import RankExchange  # noqa: E402

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


def worker(rank: int, n: int, port: int, windows: int, period_s: float, kill: bool, backend: str, results: Any) -> None:
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers "fake"

    if kill:  # a run of seconds: a rank silent for 8 exchanges and 0.5 s is gone (a real run: 30 s)
        ranks_module.STALE_S = 0.5

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
    ex.store = timed = TimedStore(ex.store)  # the thread reads self.store at each request
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
        "rank": rank, "setup_ms": setup_ms, "exchange_us": statistics.median(exchange_us), "finish_ms": finish_ms,
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


def run(n: int, windows: int, period_s: float, kill: bool, backend: str, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    t0 = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, n, port, windows, period_s, kill, backend, results)) for r in range(n)]
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
    others = [r for r in ranks if r["rank"] != 0]
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
        + (f"{statistics.median(r['exchange_us'] for r in others):5.1f} us" if others else "-")
        + f" | per window: a rank {per_rank_req:.1f} requests {per_rank_ms:.2f} ms; rank 0 "
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
    """What a rank sends for one window of these phases."""
    from phase_timer.ranks import _json, encode

    window = [7, 399, 50, {p: [123.456789, 50] for p in PHASES}]
    return len(encode(3, [_json(window)]))


def rank0_cost(n: int, windows: int = 9) -> tuple[float, float]:
    """Rank 0's work per window at ``n`` ranks, in this process: (thread's decode ms, training thread's ms).

    The thread reads one buffer of ``n - 1`` frames and decodes it; the training thread
    takes the reports in, makes the window and its scalars (what ``exchange()`` and the
    core do).  Both hold the GIL, so both are time taken from training.
    """
    from phase_timer.metrics import rank_scalars
    from phase_timer.ranks import _json, decode, encode

    ex = RankExchange(None, 0, n, "model")  # no store: the frames are put in by hand
    decode_ms, train_ms = [], []
    for w in range(windows):
        buf = b"".join(
            encode(r, [_json([w, 50 * w + 49, 50, {p: [50 * (1.0 + r / n), 50] for p in PHASES}])]) for r in range(1, n)
        )
        t = time.perf_counter_ns()
        frames, _ = decode(buf)
        decode_ms.append((time.perf_counter_ns() - t) / 1e6)
        for frame in frames:
            ex._inbox.put(frame)
        t = time.perf_counter_ns()
        ex.add(w, 50 * w + 49, 50, {p: [1.0] * 50 for p in PHASES})
        for window in ex._arrived(final=False):
            rank_scalars(window)
        train_ms.append((time.perf_counter_ns() - t) / 1e6)
    ex._todo.put(("stop",))
    return statistics.median(decode_ms), statistics.median(train_ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,8,16,32")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--period", type=float, default=0.05, help="seconds per window")
    ap.add_argument("--kill", action="store_true", help="rank 1 vanishes after 2 windows")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "fake"),
                    help="the job's own process group (fake: no connections, the store alone)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--rank0-model", default="256,1024,4096", help="rank 0's work per window at these rank counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [
        f"rank exchange through the job's TCPStore ({args.backend} job), {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}; "
        f"{args.windows} windows of {args.period * 1e3:.0f} ms; {frame_bytes()} bytes a rank sends per window "
        f"({len(PHASES)} phases)"
    ]
    results, failed = [], []
    for n in map(int, args.ranks.split(",")):
        res = run(n, args.windows, args.period, args.kill, args.backend, args.timeout)
        results.append(res)
        line, ok = summarize(res, args.windows, args.kill)
        lines.append(line)
        if not ok:
            failed.append(n)
        print(lines[-1], flush=True)
    for n in map(int, filter(None, args.rank0_model.split(","))):
        dec, train = rank0_cost(n)
        lines.append(f"rank 0 at {n:5d} ranks (in-process model): per window, decode {dec:6.2f} ms on the exchange's "
                     f"thread, {train:6.2f} ms on the training thread")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(results, f)
    if failed:
        sys.exit(f"the exchange failed a check at {failed} ranks (see the lines above)")


if __name__ == "__main__":
    main()
