#!/usr/bin/env python
"""Export a checkpoint's model (Hugging Face Llama by default): see trainer3d/checkpoint/export.py.

    python tools/export_model.py outputs/.../checkpoints/step_00000300 exported/ [--dtype bf16]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer3d.checkpoint.export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
