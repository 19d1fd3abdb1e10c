"""``python -m phase_timer.report LOGDIR ...``: the report alone, as ``phase-timer report`` (``phase_timer.cli.report``)."""

from __future__ import annotations

import sys

from phase_timer.cli.report import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m phase_timer.report"))
