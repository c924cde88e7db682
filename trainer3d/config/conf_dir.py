"""Where Hydra's config groups live: ``conf/`` beside the package in a checkout (or an editable
install), else the copy an installed package carries as ``trainer3d/conf`` (pyproject.toml ``[tool.setuptools]``).

An absolute directory, given to ``hydra.main``: a relative ``config_path`` is read by Hydra as
a Python package when the entry point is imported rather than run as ``__main__`` (the
console script), and there is no package named ``conf``.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
CONF_DIR = next((d for d in (_PACKAGE.parent / "conf", _PACKAGE / "conf") if (d / "config.yaml").is_file()),
                _PACKAGE.parent / "conf")
