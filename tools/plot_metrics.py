#!/usr/bin/env python
"""Loss and throughput curves of runs or a sweep (docs/metrics.md): trainer3d/tools/plot_metrics.py, also installed as ``trainer3d-plot-metrics``
(and ``python -m trainer3d.tools.plot_metrics``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.plot_metrics import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
