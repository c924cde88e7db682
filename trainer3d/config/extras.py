"""Optional dependencies, one pyproject.toml extra per documented feature, and the one line a
missing one gives (the pip command that installs it) instead of a ModuleNotFoundError.

    pip install 'trainer3d[plot]'          tools/plot_metrics.py, tools/plot_schedule.py (matplotlib)
    pip install 'trainer3d[tensorboard]'   logger=tensorboard (docs/metrics.md)
    pip install 'trainer3d[all]'           every one of them

The core install trains, logs to wandb (offline unless a key is set), plans, prepares data
(tokenizers, zstandard) and reads and writes Hugging Face directories (safetensors,
tokenizers): those are imported on the training and export paths, so they are not optional. tests/unit/test_extras.py holds ``EXTRAS`` to
pyproject.toml's extras.
"""

import importlib.util
from typing import Dict, Optional, Tuple

EXTRAS: Dict[str, Tuple[str, ...]] = {
    "plot": ("matplotlib",),
    "tensorboard": ("tensorboard",),
}
"""extra -> the modules it provides."""


def missing(extra: str, who: str) -> Optional[str]:
    """The one line saying ``who`` needs ``extra`` and how to install it; None if it is installed."""
    absent = [m for m in EXTRAS[extra] if _absent(m)]
    if not absent:
        return None
    return f"{who} needs {', '.join(absent)}, which the {extra} extra installs: pip install 'trainer3d[{extra}]'"


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        return True


def require(extra: str, who: str) -> None:
    """Exit with ``missing``'s line (status 2) if ``extra`` is not installed."""
    line = missing(extra, who)
    if line:
        raise SystemExit(line)
