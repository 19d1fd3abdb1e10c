"""``phase-timer run``'s start-up hook: Python imports this ``sitecustomize`` first in the script's process
(its folder leads ``PYTHONPATH``).  It imports phase-timer from where ``phase-timer run`` found it, installs
the Trainer hook (:mod:`phase_timer.doors.autorun`), then imports the ``sitecustomize`` this one shadows, if
there is one.  A failure here warns on stderr and the script runs untimed: never a start-up that breaks."""

import importlib
import os
import sys


def _boot() -> None:
    root, boot = os.environ.get("PHASE_TIMER_RUN_ROOT"), os.environ.get("PHASE_TIMER_RUN_BOOT")
    if root:
        sys.path.insert(0, root)
    try:
        from phase_timer.doors import autorun

        autorun.install()
    except Exception as err:  # noqa: BLE001 - the script runs untimed rather than not at all
        print(f"phase-timer run: the start-up hook failed ({type(err).__name__}: {err}); the script runs untimed",
              file=sys.stderr)
    finally:
        if root and sys.path and sys.path[0] == root:
            del sys.path[0]
    _chain(boot)


def _chain(boot: str | None) -> None:
    """The next ``sitecustomize`` on the path (a virtualenv's, a cluster's), as if ours were not there."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in (here, os.path.abspath(boot or here))]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as err:
        if err.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if mine is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = mine


_boot()
