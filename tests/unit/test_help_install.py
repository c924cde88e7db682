"""One install, every documented path: ``--help`` of train and plan lists every knob with its
value, valid values and docstring; the installed ``trainer3d`` command runs from any
directory, also from a non-editable install that carries conf/ inside the package, and so do
the user tools' commands (``trainer3d-prepare-data`` ...) and a checkout's tools/ scripts; a
logger whose extra is missing is refused in one line (tests/unit/test_extras.py: the extras)."""

import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.test_knobs import _leaves
from trainer3d.config.help import field_docs
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.plan.settings import PlanConfig

CONSOLE = Path(sys.executable).parent / "trainer3d"


ASKED = [("trainer3d.train",), ("trainer3d.plan",), ("trainer3d.train", "model=7b")]
"""The ``python -m MODULE [OVERRIDES] --help`` command lines these tests read."""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    """What each ASKED command line prints, then the ``trainer3d`` console script's dry run
    (CONSOLE, the script as its interpreter runs it), the checkout's tools/import_megatron.py
    --help, and the train entry point with the tensorboard extra missing, all one after another in
    one fresh process (tests/support/run_scripts.py, as ``python -m`` runs a module and ``python
    SCRIPT`` a script: torch imported once) from a directory outside the checkout: {asked: stdout},
    and the others' results (with the run dirs of the two runs)."""
    assert CONSOLE.is_file(), f"{CONSOLE}: the `trainer3d` console script of pyproject.toml is not installed"
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    entries = [[f"-m {module}", [*args, "--help"]] for module, *args in ASKED]
    entries.append([str(CONSOLE), ["dry_run=true", "parallel=single", "hydra.run.dir=run"]])
    entries.append([str(ROOT / "tools" / "import_megatron.py"), ["--help"]])  # a checkout script, as python runs it
    # last: the train entry point with tensorboard unimportable (hidden for the rest of the process)
    hidden = elsewhere / "without_tensorboard.py"
    hidden.write_text("import sys\nsys.modules['tensorboard'] = None\nfrom trainer3d.train import main\nmain()\n")
    entries.append([str(hidden), ["logger=tensorboard", "parallel=single", "train.max_steps=1", "hydra.run.dir=run-tb"]])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "run_scripts.py"), json.dumps(entries)],
                          capture_output=True, text=True, timeout=300, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(entries), proc.stdout[-3000:]
    assert [r["code"] for r in results[:len(ASKED)]] == [0] * len(ASKED), [r["stderr"] for r in results]
    console, checkout_script, without_tensorboard = results[len(ASKED):]
    return {**{asked: r["stdout"] for asked, r in zip(ASKED, results)}, "console": (console, elsewhere / "run"),
            "checkout script": checkout_script, "without tensorboard": (without_tensorboard, elsewhere / "run-tb")}


@pytest.mark.parametrize("module, schema", [("trainer3d.train", Config), ("trainer3d.plan", PlanConfig)])
def test_help_lists_every_knob_with_its_value_range_and_docstring(module, schema, helps):
    text = helps[(module,)]
    lines = text.splitlines()
    for knob, _ in _leaves(schema):
        assert any(line.startswith(f"  {knob} = ") for line in lines), f"{knob} missing from --help"
    assert "  model.dim = 128 (>= 1)" in lines
    assert any(line.startswith("  train.dtype = ") and line.endswith(" (fp32 | bf16 | fp16)") for line in lines)
    docs = field_docs(ModelConfig)
    at = lines.index("  model.vocab_size = 257 (>= 1)")
    assert " ".join(line.strip() for line in lines[at + 1:at + 3]).startswith(docs["vocab_size"][:60])
    assert "  model: " in text and "tiny" in text  # the config groups and their options


def test_help_shows_values_under_the_given_overrides(helps):
    assert "  model.dim = 4096 (>= 1)" in helps[("trainer3d.train", "model=7b")].splitlines()


def test_field_docs_are_the_schemas_docstrings():
    docs = field_docs(Config)
    assert docs["dry_run"].startswith("Validate and print") and "run_dir" in docs
    hints = typing.get_type_hints(ModelConfig)
    assert set(field_docs(ModelConfig)) <= set(hints)


def test_pyproject_lists_every_package_and_ships_conf():
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "trainer3d").rglob("__init__.py")}
    assert set(tool["packages"]) == tree | {"trainer3d.conf"}, "a package missing from pyproject.toml is not installed"
    assert tool["package-dir"] == {"trainer3d.conf": "conf"}


def test_the_console_command_runs_from_any_directory(helps):
    result, run_dir = helps["console"]
    assert result["code"] == 0, result["stderr"][-3000:]
    assert "rank" in result["stdout"] and run_dir.is_dir()


def test_a_checkout_script_runs_from_another_directory(helps):
    result = helps["checkout script"]
    assert result["code"] == 0 and "--vocab-size" in result["stdout"], result["stderr"][-3000:]


def test_a_logger_without_its_extra_is_refused_before_launch_in_one_line(helps):
    """trainer3d/config/extras.py: ``logger=tensorboard`` without tensorboard importable."""
    result, run_dir = helps["without tensorboard"]
    assert result["code"] == 2 and result["stderr"].strip().splitlines() == [
        "trainer3d: config error: logger=tensorboard needs tensorboard, which the tensorboard extra installs: "
        "pip install 'trainer3d[tensorboard]'"], result["stderr"]
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_non_editable_install_carries_conf_and_every_cpp_source(tmp_path):
    """``pip install .`` (no checkout beside it): conf/ travels as trainer3d/conf, and every C++
    source of the tree (built on first use, trainer3d/cpu/build.py) travels beside its module,
    byte for byte: a source left out of the package data makes its user fall back in silence."""
    source, target = tmp_path / "src", tmp_path / "site"  # a copy: the build writes build/ beside the sources
    for name in ("trainer3d", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert pip.returncode == 0, pip.stderr[-2000:]
    assert (target / "trainer3d" / "conf" / "config.yaml").is_file()
    assert (target / "trainer3d" / "conf" / "model" / "tiny.yaml").is_file()
    tree = {p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "trainer3d").rglob("*.cpp")}
    shipped = {p.relative_to(target): p.read_bytes() for p in (target / "trainer3d").rglob("*.cpp")}
    assert len(tree) >= 3 and shipped.keys() == tree.keys(), sorted(map(str, tree.keys() ^ shipped.keys()))
    assert shipped == tree
    # In one fresh process (tests/support/run_scripts.py: one import of torch, not six), from
    # elsewhere with the install on PYTHONPATH: where the installed package finds conf/, the
    # console scripts pip wrote and the sample tool's module, and the `trainer3d` command's dry run.
    where = tmp_path / "conf_dir.py"
    where.write_text("from trainer3d.config.conf_dir import CONF_DIR\nprint(CONF_DIR)\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    scripts = [[str(target / "bin" / name), ["--help"]] for name in
               ("trainer3d", "trainer3d-prepare-data", "trainer3d-plot-metrics", "trainer3d-plan")]
    dry_run = [str(target / "bin" / "trainer3d"), ["dry_run=true", "parallel=single", "hydra.run.dir=run"]]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "run_scripts.py"),
                           json.dumps([[str(where), []], *scripts, ["-m trainer3d.tools.sample", ["--help"]], dry_run])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 7, proc.stdout[-3000:]
    assert results[0]["code"] == 0 and results[0]["stdout"].splitlines() == [str(target / "trainer3d" / "conf")], results[0]
    assert results[6]["code"] == 0, results[6]["stderr"][-3000:]
    assert "rank" in results[6]["stdout"], results[6]["stdout"][-3000:]
    results = results[1:6]
    for (script, _), result in zip(scripts, results):
        assert result["code"] == 0 and "usage:" in result["stdout"], (script, result["stderr"][-2000:])
    assert results[4]["code"] == 0 and "--prompt" in results[4]["stdout"], results[4]["stderr"][-2000:]
