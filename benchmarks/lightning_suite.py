"""Lightning's own test suite with ``PhaseTimer(summary=False)`` appended to every ``Trainer``.

Does the callback leave Lightning as it found it?  Runs a Lightning source checkout's tests
twice, without and with the callback injected (a pytest plugin wraps ``Trainer.__init__`` of
both namespaces), and lists the tests that pass without it and fail with it.  Those that
assert the exact callback list are expected to (the callback is one more); any other is a
defect.  Needs a Lightning source checkout (``tests/tests_pytorch``) of the installed version
or near it, and its test requirements (``cloudpickle``, ``scikit-learn``, ``psutil``): not CI.

    git clone https://github.com/Lightning-AI/pytorch-lightning && git -C pytorch-lightning checkout 2.6.5
    python benchmarks/lightning_suite.py pytorch-lightning/tests --out benchmarks/results/lightning_suite_cpu.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Loops, optimization, hooks, flags, dataloaders, LR monitor, early stopping, checkpointing, callback connector.
SUBSETS = (
    "tests_pytorch/loops",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/trainer/test_dataloaders.py",
    "tests_pytorch/trainer/connectors/test_data_connector.py",
    "tests_pytorch/trainer/connectors/test_callback_connector.py",
    "tests_pytorch/callbacks/test_lr_monitor.py",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/checkpointing",
)

PLUGIN = '''
import functools, importlib, sys

def _inject(ns):
    try:
        trainer_cls = importlib.import_module(ns).Trainer
    except ImportError:
        return
    init = trainer_cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, callbacks=None, **kwargs):
        from phase_timer import PhaseTimer
        callbacks = [] if callbacks is None else [callbacks] if not isinstance(callbacks, list) else list(callbacks)
        init(self, *args, callbacks=[*callbacks, PhaseTimer(summary=False)], **kwargs)

    trainer_cls.__init__ = __init__

def pytest_configure(config):
    for ns in ("lightning.pytorch", "pytorch_lightning"):
        if ns in sys.modules:  # only the namespaces the tests import
            _inject(ns)
'''


def run_pass(tests_dir: str, subsets: list[str], inject: bool, junit: str, timeout_s: int, workers: int) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, ROOT, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={junit}",
           f"--timeout={timeout_s}", *(["-n", str(workers)] if workers > 1 else []), *subsets,
           # needs Lightning's archive of legacy checkpoints, downloaded by its CI: fails with and without
           "--ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py"]
    if inject:
        plugin_dir = tempfile.mkdtemp()
        with open(os.path.join(plugin_dir, "phase_timer_injected.py"), "w") as f:
            f.write(PLUGIN)
        env["PYTHONPATH"] = plugin_dir + os.pathsep + env["PYTHONPATH"]
        # import lightning.pytorch before the plugin configures, as the tests do
        cmd[3:3] = ["-p", "lightning.pytorch", "-p", "phase_timer_injected"]
    t0 = time.time()
    subprocess.run(cmd, cwd=tests_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - t0


def outcomes(junit: str) -> dict[str, str]:
    """test id -> passed | failed | error | skipped."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[key] = ("failed" if "failure" in kinds else "error" if "error" in kinds else
                    "skipped" if "skipped" in kinds else "passed")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", help="a Lightning checkout's tests/ folder (holds tests_pytorch/)")
    parser.add_argument("--subset", action="append", help="test paths under tests_dir (default: SUBSETS)")
    parser.add_argument("--timeout", type=int, default=120, help="per test, seconds")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist processes (1: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    subsets = args.subset or list(SUBSETS)
    tmp = tempfile.mkdtemp()
    runs = {}
    for inject in (False, True):
        junit = os.path.join(tmp, f"{'with' if inject else 'without'}.xml")
        secs = run_pass(args.tests_dir, subsets, inject, junit, args.timeout, args.workers)
        runs[inject] = (outcomes(junit), secs)
    without, with_ = runs[False][0], runs[True][0]
    import lightning
    import phase_timer

    lines = [f"Lightning's tests ({args.tests_dir}), lightning {lightning.__version__}, phase_timer from "
             f"{os.path.dirname(phase_timer.__file__)}, {time.strftime('%Y-%m-%d')}",
             "subsets: " + ", ".join(subsets)]
    for name, (res, secs) in (("without", runs[False]), ("with PhaseTimer(summary=False)", runs[True])):
        counts = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "error", "skipped")}
        lines.append(f"{name:32s} " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f"  ({secs:.0f} s)")
    broken = sorted(t for t, v in with_.items() if v in ("failed", "error") and without.get(t) == "passed")
    lines.append(f"pass without, fail with the callback: {len(broken)}")
    lines += [f"  {t}" for t in broken]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
