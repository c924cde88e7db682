#!/usr/bin/env python
"""A checkpoint's model as a Hugging Face directory (docs/huggingface.md): trainer3d/tools/export_model.py, also installed as ``trainer3d-export-model``
(and ``python -m trainer3d.tools.export_model``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.export_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
