#!/usr/bin/env python
"""Pipeline schedules' timelines drawn from their action lists (docs/parallelism.md): trainer3d/tools/plot_schedule.py, also installed as ``trainer3d-plot-schedule``
(and ``python -m trainer3d.tools.plot_schedule``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.plot_schedule import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
