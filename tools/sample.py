#!/usr/bin/env python
"""Text from a checkpoint or a Hugging Face directory: trainer3d/tools/sample.py, also installed as ``trainer3d-sample``
(and ``python -m trainer3d.tools.sample``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.sample import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
