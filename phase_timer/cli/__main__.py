"""``python -m phase_timer.cli report|compare ...``: the ``phase-timer`` console script, run as a module."""

import sys

from phase_timer.cli.commands import main

sys.exit(main())
