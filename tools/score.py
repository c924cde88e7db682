#!/usr/bin/env python
"""Per-document scores of a token file: trainer3d/tools/score.py, also installed as ``trainer3d-score``
(and ``python -m trainer3d.tools.score``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.score import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
