#!/usr/bin/env python
"""A GPU node's first check — the GPU tier, a resume probe, a bf16 + compile MFU run and the
planner's error on it (docs/gpu.md, "The first hour on a new cluster"):
trainer3d/tools/gpu_check.py, also installed as ``trainer3d-gpu-check`` (and
``python -m trainer3d.tools.gpu_check``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
