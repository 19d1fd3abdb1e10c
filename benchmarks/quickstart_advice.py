"""The quickstart's INPUT_BOUND advice, followed, on the machine it runs on (issue 36).

Runs ``examples/lightning_quickstart.py`` as shipped and with its DataLoader made as an advice says, each in a
fresh process, the variants interleaved ``--pairs`` times, and prints each run's ``period`` (p50 and mean, ms),
``data_wait``'s share, and its verdict's first advice.  Only the DataLoader's construction changes: the example's
own ``main()`` runs, with ``DataLoader`` in its namespace replaced.

    python benchmarks/quickstart_advice.py --pairs 3 --out benchmarks/results/quickstart_advice_cpu.txt

Variants: ``shipped`` (``num_workers=0``); ``workers2``: ``num_workers=2``, what phase-timer advised before issue
36; ``batched``: the advice now, a whole batch indexed at once (``BatchSampler`` as the sampler, ``batch_size=None``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.provenance import code_line  # noqa: E402

VARIANTS = ("shipped", "workers2", "batched")

CHILD = r'''
import importlib.util, sys
import torch.utils.data as tud

variant, root, steps = sys.argv[1], sys.argv[2], sys.argv[3]
spec = importlib.util.spec_from_file_location("quickstart", sys.argv[4])
qs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qs)


def advised(dataset, batch_size=1, shuffle=False, **kw):
    if variant == "workers2":
        return tud.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=2, **kw)
    if variant == "batched":
        sampler = tud.RandomSampler(dataset) if shuffle else tud.SequentialSampler(dataset)
        return tud.DataLoader(dataset, sampler=tud.BatchSampler(sampler, batch_size, drop_last=False), batch_size=None, **kw)
    return tud.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, **kw)


qs.DataLoader = advised
sys.argv = ["lightning_quickstart.py", "--steps", steps, "--root", root]
qs.main()
'''


def run_once(variant: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        env = {**os.environ, "PYTHONPATH": ROOT}
        proc = subprocess.run([sys.executable, "-c", CHILD, variant, root, str(steps),
                               os.path.join(ROOT, "examples", "lightning_quickstart.py")],
                              env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
        path = os.path.join(root, "lightning_logs", "version_0", "phase_timer_summary.json")
        with open(path) as f:
            data = json.load(f)
    phases, d = data["phases"], data["diagnosis"]
    return {"variant": variant, "period_p50": phases["period"]["p50_ms"], "period_mean": phases["period"]["mean_ms"],
            "data_wait_share": phases["data_wait"]["share"], "verdict": f"{d['kind']} ({d['severity']})",
            "next": (d["next"] or [""])[0], "cpu": d["evidence"].get("cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--note", default="", help="a line for the file: how the machine was shared, say")
    args = parser.parse_args()
    variants = args.variants.split(",")
    lines = [code_line(), f"examples/lightning_quickstart.py --steps {args.steps}, {os.cpu_count()} cores; "
             f"variants interleaved, {args.pairs} rounds, a fresh process each", *([args.note] if args.note else []), ""]
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.pairs):
        for v in variants:
            r = run_once(v, args.steps)
            rows[v].append(r)
            line = (f"round {i + 1} {v:9s} period p50 {r['period_p50']:.2f} ms, mean {r['period_mean']:.2f} ms; "
                    f"data_wait {100 * r['data_wait_share']:.0f}%; {r['verdict']}; next: {r['next'][:160]}")
            lines.append(line)
            print(line, flush=True)
    lines.append("")
    for v in variants:
        p50s = sorted(r["period_p50"] for r in rows[v])
        lines.append(f"{v:9s} period p50 by round: {', '.join(f'{x:.2f}' for x in p50s)} ms (sorted)")
    text = "\n".join(lines) + "\n"
    print(text[text.index("\n\n") + 2:] if "\n\n" in text else text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
