"""A plain DDP loop under torchrun, with phase-timer attached; used by the distributed tests.

    torchrun --standalone --nproc_per_node 2 tests/dist_scripts/plain_ddp.py --log-dir DIR

One rank can be slowed on purpose (a sleep in its forward or its data loading; on the
CPU, ``--planted-hours`` also moves its host clock an hour per millisecond of the forward's
sleep, so its lead is hours that no load on the runner can blur);
``--no-ddp`` trains independent models so the ranks may run different numbers of
steps (``--extra-steps``) without DDP itself hanging.  Rank zero prints the
summary and a last line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import phase_timer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, run by torchrun
from helpers import HostHours, SleepyData  # noqa: E402

#: The host clock with planted hours (``--planted-hours``), or None.
_CLOCK: HostHours | None = None


class Pause(nn.Module):
    """The slow rank's sleep in forward, a module of its own (``--modules`` names it)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)  # on CUDA: the GPU idles inside forward, as a slow host would make it
            if _CLOCK is not None:
                _CLOCK.jump(1000 * self.seconds)
        return x


class Net(nn.Module):
    def __init__(self, width: int, forward_sleep_s: float, depth: int = 1) -> None:
        super().__init__()
        hidden = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        self.body = nn.Sequential(nn.Linear(32, width), nn.ReLU(), *hidden, nn.Linear(width, 1))
        self.pause = Pause(forward_sleep_s)

    @property
    def forward_sleep_s(self) -> float:
        return self.pause.seconds

    @forward_sleep_s.setter
    def forward_sleep_s(self, seconds: float) -> None:
        self.pause.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.pause(x))


def main() -> None:
    global _CLOCK
    p = argparse.ArgumentParser()
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=23)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-forward", type=float, default=0.0, help="seconds of sleep in the slow rank's forward")
    p.add_argument("--slow-from", type=int, default=0, help="the slow rank's forward sleeps from this step on only")
    p.add_argument("--slow-data", type=float, default=0.0, help="seconds of sleep per item in the slow rank's loader")
    p.add_argument("--planted-hours", action="store_true",
                   help="CPU: the slow forward's sleep also moves the host clock an hour per ms (tests/helpers.py)")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--extra-steps", type=int, default=0, help="steps --extra-rank runs beyond --steps (with --no-ddp)")
    p.add_argument("--extra-rank", type=int, default=0)
    p.add_argument("--fail-at", type=int, default=0, help="the slow rank raises in this step's forward")
    p.add_argument("--rank-timeout", type=float, default=30.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--fsdp", action="store_true", help="FullyShardedDataParallel instead of DDP")
    p.add_argument("--fsdp2", action="store_true", help="FSDP2 (fully_shard on each Linear and the root) instead of DDP")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--profile-syncs", action="store_true", help="CUDA: count sync calls in the profiler's trace")
    p.add_argument("--no-timer", action="store_true")
    p.add_argument("--modules", action="store_true", help="which module on (modules=True)")
    p.add_argument("--bench-from", type=int, default=0, help="report ms per step from this step to the end")
    p.add_argument("--fake-memory-extra", type=float, default=None,
                   help="plant a fake allocator on every rank (1000 MB held); the slow rank holds this many MB more")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if args.planted_hours and not cuda:  # before the timer exists: its engine takes the clock at construction
        _CLOCK = HostHours()
        time.perf_counter_ns = _CLOCK
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    slow = rank == args.slow_rank
    torch.manual_seed(0)
    model = Net(args.width, args.slow_forward if slow and not args.slow_from else 0.0, args.depth).to(device)
    if args.no_ddp:
        ddp = model
    elif args.fsdp:
        from torch.distributed.fsdp import FullyShardedDataParallel

        ddp = FullyShardedDataParallel(model, device_id=device if cuda else None)
    elif args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        ddp = fully_shard(model)
    else:
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = SleepyData(8192, args.slow_data if slow else 0.0, width=32)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=True), pin_memory=cuda, drop_last=True)
    steps = args.steps + (args.extra_steps if rank == args.extra_rank else 0)

    if args.fake_memory_extra is not None:  # memory on the CPU: the counters a CUDA rank's allocator would give
        from fakes import FakeAllocator

        from phase_timer.measures import memory as timer_memory

        fake = FakeAllocator()
        fake.alloc(1000 + (args.fake_memory_extra if slow else 0))
        timer_memory.reader_for = lambda clock: (fake.read, fake.info)
    timer = phase_timer.attach(
        ddp, opt, loader, copy_to_device=True, log_dir=args.log_dir, window=args.window, warmup_steps=2,
        rank_timeout_s=args.rank_timeout, enabled=not args.no_timer, modules=args.modules,
    )
    prof = None
    if args.profile_syncs:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    done = 0
    micro = 0
    profiling = False
    epoch = 0
    t_start = time.perf_counter()
    with timer:
        while done < steps:
            loader.sampler.set_epoch(epoch)
            epoch += 1
            for x, y in timer.loader:
                if prof is not None and done == 10 and not profiling:
                    profiling = True
                    prof.start()
                micro += 1
                if slow and args.slow_from and done == args.slow_from:
                    model.forward_sleep_s = args.slow_forward  # the rank turns slow here, for good
                last = micro % args.accumulate == 0
                # no_sync: the micro-batches before the last keep their gradients local
                ctx = ddp.no_sync() if (not last and not args.no_ddp) else contextlib.nullcontext()
                if args.fail_at and slow and done == args.fail_at:
                    raise RuntimeError(f"planted failure on rank {rank}")
                with ctx:
                    loss = nn.functional.mse_loss(ddp(x), y) / args.accumulate
                    loss.backward()
                if not last:
                    continue
                opt.step()
                opt.zero_grad(set_to_none=True)
                done += 1
                if args.bench_from and done == args.bench_from:
                    _device_sync(cuda)
                    t_bench = time.perf_counter()
                if profiling and done == steps - 3:
                    profiling = False
                    prof.stop()
                    prof = _count_syncs(prof)
                if done == steps:
                    _device_sync(cuda)
                    t_last = time.perf_counter()  # the steady state ends here; the timer's close is apart
                    break
    _device_sync(cuda)
    t_end = time.perf_counter()
    wall = t_end - t_start
    if rank == 0:
        result = {"log_dir": timer.log_dir, "summary": timer.last_summary, "wall_s": wall, "steps": done,
                  "diagnosis": timer.diagnosis.as_dict() if timer.diagnosis is not None else None}
        if args.bench_from:
            result["step_ms"] = (t_last - t_bench) * 1e3 / (done - args.bench_from)
            result["close_ms"] = (t_end - t_last) * 1e3  # the end: drain, the ranks' last reports, the files
        if isinstance(prof, dict):
            result["syncs"] = prof
        print("RESULT " + json.dumps(result), flush=True)
    elif rank == 1 and isinstance(prof, dict):  # rank 1 alone: more ranks' lines would interleave in torchrun's stdout
        print("RANK1SYNCS " + json.dumps(prof), flush=True)
    dist.destroy_process_group()


def _device_sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()  # the benchmark's own clock edges, outside the timed steps


def _count_syncs(prof: object) -> dict[str, int]:
    names = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
    counts = dict.fromkeys(names, 0)
    for e in prof.events():  # type: ignore[attr-defined]
        if e.name in counts:
            counts[e.name] += 1
    return counts


if __name__ == "__main__":
    main()
