#!/usr/bin/env python
"""A Megatron-LM indexed dataset (.bin + .idx) -> a token file (docs/data.md): trainer3d/tools/import_megatron.py, also installed as ``trainer3d-import-megatron``
(and ``python -m trainer3d.tools.import_megatron``). This script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.import_megatron import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
