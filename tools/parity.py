#!/usr/bin/env python
"""Two layouts of one run trained and their per-step losses compared (docs/parallelism.md): trainer3d/tools/parity.py, also installed as ``trainer3d-parity``
(and ``python -m trainer3d.tools.parity``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.parity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
