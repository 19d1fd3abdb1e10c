"""``phase-timer run``: times an unmodified training script.

Usage::

    phase-timer run [OPTIONS] -- python train.py ARGS
    phase-timer run [OPTIONS] -- torchrun --nproc-per-node 8 train.py ARGS

Every Lightning ``Trainer`` and 🤗 ``Trainer`` the script builds gets the callback (``PhaseTimer``,
``PhaseTimerCallback``) with OPTIONS, unless it was given one already: the script's own ``callbacks`` win.
OPTIONS are the doors' arguments, with the same names (``--log-dir``, ``--window``, ``--per-step``, ...;
``--window`` is Lightning's ``log_every_n_steps``), checked before the script starts.  How: a
``sitecustomize`` of phase-timer's leads the script's ``PYTHONPATH`` (:mod:`phase_timer.doors.autorun` says
what it does, and which processes keep it in their environment); a script that builds no Trainer has its
hand-written loop timed from its third step (:mod:`phase_timer.doors.autoloop`).  The script's output and exit
status are its own; ``phase-timer run`` adds at most a line on stderr at the end: that the script failed (its
status), the loop it timed, or why a script with no Trainer was not timed.

Exit status: the script's (a signal N: 128 + N); 2 for bad OPTIONS or no command; 127 for a command not found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from phase_timer.cli.errors import PROG, ReportError

RUN_HELP = ("Time an unmodified script: every Lightning and 🤗 Trainer it builds gets phase-timer's callback with "
            "these options (the doors' argument names).  phase-timer run [OPTIONS] -- python train.py ARGS")
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
#: Where ``import phase_timer`` finds this copy of it (given to the script's process).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Each option: (type, help).  ``bool``: ``--x`` / ``--no-x``.  The doors' arguments a command line cannot give
#: (functions of a batch) are left out; ``tests/cli/test_watch_run.py`` holds these to the doors' options.
OPTIONS: dict[str, tuple[Any, str]] = {
    "log_dir": (str, "where the files go when the Trainer has no logger of its own"),
    "window": (int, "steps per logging window (default: the Trainer's log_every_n_steps / logging_steps)"),
    "warmup_steps": (int, "optimizer steps at the start that are not timed (default 5)"),
    "max_pending": (int, "steps that may wait for the device before new ones go untimed (default 64)"),
    "per_step": (bool, "also write every step's values"),
    "summary": (bool, "print the table at the end (default on)"),
    "nvtx": (bool, "also push each phase as an NVTX range"),
    "trace_steps": (int, "FIRST STOP: a Perfetto trace of these steps"),
    "trace_path": (str, "the trace's file"),
    "rank_timeout_s": (float, "how long rank zero waits at the end for the other ranks (default 30)"),
    "memory": (bool, "read the CUDA allocator's counters on sampled steps (default on)"),
    "samples_per_batch": (int, "a batch's samples, for throughput"),
    "tokens_per_batch": (int, "a batch's tokens, for throughput"),
    "flops_per_step": (float, "the FLOPs of an optimizer step, for MFU"),
    "peak_tflops": (float, "the device's dense peak in TFLOP/s, for MFU"),
    "mfu": (bool, "count FLOPs for MFU (default on)"),
    "memory_snapshot": (str, "CUDA: record the allocator's history: true, end, or a path"),
    "modules": (bool, "which module: each module's forward/backward time on sampled steps (default off)"),
}


def add_run_args(parser: argparse.ArgumentParser) -> None:
    for name, (kind, help_) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif name == "trace_steps":
            parser.add_argument(flag, dest=name, type=int, nargs=2, metavar=("FIRST", "STOP"), help=help_)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=help_)
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the script's command line, after --")


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, checked as the doors check them."""
    from phase_timer.doors.options import Options

    opts = {k: getattr(args, k) for k in OPTIONS if getattr(args, k, None) is not None}
    snapshot = opts.get("memory_snapshot")
    if snapshot in ("true", "True"):
        opts["memory_snapshot"] = True
    check = {**opts, **({"trace_steps": tuple(opts["trace_steps"])} if "trace_steps" in opts else {})}
    try:
        Options(**check, owner="phase-timer run")
    except (TypeError, ValueError) as err:
        raise ReportError(str(err)) from err
    return opts


def child_env(opts: dict[str, Any], report_dir: str) -> dict[str, str]:
    from phase_timer.doors.autorun import ENV_BOOT, ENV_OPTIONS, ENV_REPORT, ENV_ROOT

    env = dict(os.environ)
    env.update({ENV_OPTIONS: json.dumps(opts), ENV_REPORT: report_dir, ENV_BOOT: BOOT, ENV_ROOT: ROOT})
    env["PYTHONPATH"] = os.pathsep.join([BOOT, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def trainers_built(report_dir: str) -> list[dict[str, Any]]:
    """What each process of the script said it built (:func:`phase_timer.doors.autorun._mark`)."""
    out = []
    for name in sorted(os.listdir(report_dir)):
        with open(os.path.join(report_dir, name)) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def run_script(args: argparse.Namespace) -> int:
    command = list(args.script)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ReportError("no command to run: phase-timer run [OPTIONS] -- python train.py ARGS")
    opts = given_options(args)
    report_dir = tempfile.mkdtemp(prefix="phase-timer-run-")
    try:
        status = _run(command, child_env(opts, report_dir))
        built = trainers_built(report_dir)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    if status in (126, 127) and not built:  # said already, by _run
        pass
    elif status != 0:
        print(f"{PROG} run: {command[0]} exited with status {status}", file=sys.stderr)
    else:
        _say_loop(built)
    return status


def _say_loop(built: list[dict[str, Any]]) -> None:
    """The last line for a script that built no Trainer: the hand-written loop timed, or why it was not."""
    if any(b["door"] != "loop" for b in built):
        return
    loops = [b for b in built if b["door"] == "loop"]
    timed = [b for b in loops if b["added"]]
    if timed:
        print(f"{PROG} run: timed the hand-written loop from its third step ({timed[0].get('note')})",
              file=sys.stderr)
        return
    why = loops[0].get("note") if loops else "no optimizer stepped twice"
    print(f"{PROG} run: the script built no Lightning or 🤗 Trainer and its loop was not timed ({why}): wrap it in "
          "`with phase_timer.attach(model, optimizer, loader) as timer:`, see the README", file=sys.stderr)


def _run(command: list[str], env: dict[str, str]) -> int:
    """The command's exit status; Ctrl-C goes to it (the same process group), not to us."""
    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError as err:
        print(f"{PROG} run: {command[0]}: command not found ({err.strerror})", file=sys.stderr)
        return 127
    except PermissionError as err:
        print(f"{PROG} run: {command[0]}: cannot run it ({err.strerror})", file=sys.stderr)
        return 126
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # the script got it too, and decides
            continue
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says it


__all__ = ["add_run_args", "run_script"]
