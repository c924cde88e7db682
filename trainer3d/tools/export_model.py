"""Export a checkpoint's model (Hugging Face Llama by default): trainer3d/checkpoint/export.py.

    python tools/export_model.py outputs/.../checkpoints/step_00000300 exported/ [--dtype bf16]
"""

import sys

from trainer3d.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
