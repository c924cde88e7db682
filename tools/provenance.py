#!/usr/bin/env python
"""Which documents fed a training step (docs/failures.md): trainer3d/tools/provenance.py, also
installed as ``trainer3d-provenance`` (and ``python -m trainer3d.tools.provenance``). This
script runs it from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.tools.provenance import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
