"""One install, every documented path: the user tools are commands of the package (and modules,
and tools/ scripts in a checkout); each optional dependency is an extra named for its feature,
`all` installs them, and a missing one is one line naming its pip command. A checkout script run
from another directory, and the entry point refusing a logger whose extra is missing, run in
tests/unit/test_help_install.py's one fresh interpreter of command lines."""

import importlib
import sys
import pytest

from tests.conftest import ROOT
from trainer3d.config.extras import EXTRAS, missing

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# a tool is a module with a command line (``def main``); ``output`` is the helper they share
TOOLS = sorted(p.stem for p in (ROOT / "trainer3d" / "tools").glob("*.py") if "\ndef main(" in p.read_text())


def test_the_extras_are_pyprojects_and_all_installs_every_one():
    extras = PYPROJECT["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert [req.split(">")[0].split("=")[0] for req in extras[extra]] == list(modules), extra
    assert extras["all"] == [f"trainer3d[{','.join(sorted(EXTRAS))}]"]
    assert "wandb" in " ".join(PYPROJECT["dependencies"])  # every run can log to wandb (offline by default)
    assert "trainer3d[all]" in extras["dev"]
    core = " ".join(PYPROJECT["dependencies"])
    assert not [m for modules in EXTRAS.values() for m in modules if m in core]


def test_every_tool_is_a_command_a_module_and_a_checkout_script():
    scripts = PYPROJECT["scripts"]
    for tool in TOOLS:
        command = "trainer3d-" + tool.replace("_", "-")
        assert command in scripts, f"{command}: no console script for trainer3d/tools/{tool}.py"
        assert (ROOT / "tools" / f"{tool}.py").is_file(), f"tools/{tool}.py: the checkout's script is missing"
    for command, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), command


def test_missing_names_the_extra_and_is_quiet_when_installed():
    assert missing("plot", "plot_metrics") is None  # the dev install has every extra
    line = _probe_missing()
    assert line == "plot_metrics needs matplotlib, which the plot extra installs: pip install 'trainer3d[plot]'"


def _probe_missing():
    saved = sys.modules.get("matplotlib")
    sys.modules["matplotlib"] = None
    try:
        return missing("plot", "plot_metrics")
    finally:
        if saved is None:
            del sys.modules["matplotlib"]
        else:
            sys.modules["matplotlib"] = saved
