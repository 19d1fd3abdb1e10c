"""Issue 47's second question, asked from outside (2 GPUs): is a host-paced DDP span's end done on the device when the
host reaches the next optimizer step, where the rank did not wait for a peer, and not done where it did?

    torchrun --standalone --nproc_per_node 2 benchmarks/paced_probe.py [--batch 2 --seq 128] [--steps 120]

``comm_nccl.py``'s ``Linears`` (DDP defaults, 200 parameter tensors); rank 1 sleeps 20 ms before its forward on
every third step, so rank 0 waits in its end-of-backward on those steps (and, its peer behind, on some others).
On rank 0 the probe wraps ``PacedSpans._settle`` (the span's end, on the host): it records an event there (after
the engine's own mark), notes the engine's answer to the first question (behind at the span's start?), the host's
ms in the span and what the correction held; from step 6 on it turns the paced path back on where it is off
(``--force 1``; a tree that asks from the first backward keeps it on itself until PACED_OFF answers "behind"); at the optimizer's step pre-hook it queries that event (never a wait).  Per step:
planted (rank 1 slept), behind, done at the optimizer, paced, the ms the correction took or held, the host's ms,
phase-timer's ``backward.comm_wait``; then the counts of (planted, done, behind).  ``--cpu``: the plumbing alone
(gloo; no device: no answers)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phase_timer  # noqa: E402
from benchmarks.comm_nccl import Linears  # noqa: E402
from phase_timer.measures.comm import paced  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--force", type=int, default=1, help="turn the paced path on from step 6 (1) or leave it to the module (0)")
    p.add_argument("--cpu", action="store_true", help="the script's plumbing alone (gloo; no device: no question)")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    net = Linears(args.vocab, args.width, args.tensors).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=None if args.cpu else [device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not args.cpu)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps)]

    rows: list[dict] = []
    state = {"step": 0, "event": None}
    original = paced.PacedSpans._settle

    def settle(self, engine, h1, kept_up=None):  # noqa: ANN001, ANN202
        ev = None if args.cpu else torch.cuda.Event()
        if ev is not None:
            ev.record()  # after the engine's own mark at the span's end
        h0 = self._h0
        behind = engine.behind()
        ms = original(self, engine, h1, kept_up)
        if args.force and not self._paced and state["step"] >= 6:
            self._pace(True)  # after the original: on again where PACED_OFF (or, on older trees, a sample) turned it off
        # a tree that asks the second question holds [mark, ms, taken] until the optimizer step (read there, below)
        rows.append({"step": state["step"], "pt_step": timer._bounds._step, "behind": behind,
                     "host_ms": (h1 - h0) / 1e6 if h0 else None, "taken": 0.0 if isinstance(ms, list) else (ms or 0.0),
                     "held": ms if isinstance(ms, list) else None, "paced": self._paced, "done_at_opt": None})
        state["event"] = ev
        return ms

    paced.PacedSpans._settle = settle

    def pre_step(_opt, _args, _kwargs):  # noqa: ANN001, ANN202
        ev = state.pop("event", None)
        state["event"] = None
        if ev is not None and rows:
            rows[-1]["done_at_opt"] = ev.query()  # a query, never a wait
        if rows and rows[-1]["held"] is not None:  # the tree's own answer: its global pre-hook ran before this one
            rows[-1]["taken"] = rows[-1]["held"][2] or 0.0

    opt.register_step_pre_hook(pre_step)
    timer = phase_timer.attach(model, opt, data, log_dir=tempfile.mkdtemp(), window=10, warmup_steps=5,
                               copy_to_device=True, summary=False, per_step=True)
    waits: dict[int, float] = {}
    consume = timer.core._consume

    def consumed(results):  # noqa: ANN001, ANN202
        for item in results or ():
            if item[0] == "step":
                waits[item[1]] = item[2].get("backward.comm_wait", float("nan"))
        consume(results)

    timer.core._consume = consumed
    with timer:
        for i, x in enumerate(timer.loader):
            state["step"] = i + 1
            if rank == 1 and i % 3 == 0:
                time.sleep(0.02)
            loss = model(x).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    if not args.cpu:
        torch.cuda.synchronize()  # deliberate: the probe's end
    if rank == 0:
        print("step planted_wait behind done_at_opt paced taken_ms host_ms comm_wait_ms")
        agree = total = 0
        for r in rows:
            planted = (r["step"] - 1) % 3 == 0
            w = waits.get(r["pt_step"])  # phase-timer's own index of the step
            print(f"{r['step']:4d} {planted!s:>5} {r['behind']!s:>6} {r['done_at_opt']!s:>6} {r['paced']!s:>6} "
                  f"{r['taken']:8.3f} {r['host_ms'] if r['host_ms'] is None else round(r['host_ms'], 3)!s:>8} "
                  f"{'-' if w is None else round(w, 3)!s:>8}")
            if r["step"] > 8 and r["done_at_opt"] is not None:
                total += 1
                agree += r["done_at_opt"] == (not planted)
        print(f"done-at-optimizer == not waiting on {agree} of {total} steps past step 8")
        from collections import Counter
        c = Counter(((r["step"] - 1) % 3 == 0, r["done_at_opt"], r["behind"]) for r in rows if r["step"] > 8)
        print("(planted, done_at_opt, behind): steps", dict(c))
        w = {k: [waits.get(r["pt_step"]) for r in rows if r["step"] > 8 and ((r["step"] - 1) % 3 == 0) == k] for k in (True, False)}
        t = {k: [r["taken"] for r in rows if r["step"] > 8 and ((r["step"] - 1) % 3 == 0) == k] for k in (True, False)}
        for k in (True, False):
            ws = sorted(x for x in w[k] if x is not None)
            print(f"planted={k}: comm_wait median {ws[len(ws)//2] if ws else None}, taken mean {sum(t[k])/max(1,len(t[k])):.3f} ms over {len(t[k])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
