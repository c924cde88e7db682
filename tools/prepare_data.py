#!/usr/bin/env python
"""Text files, directories and JSON Lines -> a token file (docs/data.md): trainer3d/tools/prepare_data.py, also installed as ``trainer3d-prepare-data``
(and ``python -m trainer3d.tools.prepare_data``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.prepare_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
