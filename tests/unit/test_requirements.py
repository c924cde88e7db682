"""The torch floor: pyproject.toml's requirement and the import-time check say the same version."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trainer3d.preflight.requirements import TORCH_FLOOR, check_torch


def test_pyproject_torch_floor_is_the_checked_one():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"torch>=([0-9.]+)"', text) == [TORCH_FLOOR]


@pytest.mark.parametrize("version", ["2.9.1+cu128", "2.10.0", "1.13.1", "2.6.0a0+git1234"])
def test_older_torch_refused_with_the_fix(version):
    with pytest.raises(ImportError, match=rf"needs torch>={TORCH_FLOOR}, this Python has torch {re.escape(version)}"):
        check_torch(version)


@pytest.mark.parametrize("version", [TORCH_FLOOR + ".0", "2.11.0+cu130", "2.12.0a0+gitabc", "2.13.0+cpu", "3.0.0"])
def test_floor_and_newer_accepted(version):
    check_torch(version)


def test_the_package_refuses_the_installed_torch_when_too_old(tmp_path):
    """``import trainer3d`` checks the installed distribution's version (trainer3d/__init__.py,
    without importing torch): a torch 2.9.1 found first on sys.path is refused with the fix."""
    info = tmp_path / "torch-2.9.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", "import trainer3d"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert f"ImportError: trainer3d needs torch>={TORCH_FLOOR}, this Python has torch 2.9.1" in proc.stderr


def test_a_torch_without_package_metadata_is_asked_its_version():
    """A torch that imports but has no installed metadata (a source tree on PYTHONPATH, some
    cluster modules' builds) is checked by its own ``torch.__version__`` (trainer3d/__init__.py),
    not refused for the missing metadata."""
    code = ("import importlib.metadata as m\n"
            "installed = m.version\n"
            "def version(name):\n"
            "    if name == 'torch':\n"
            "        raise m.PackageNotFoundError(name)\n"
            "    return installed(name)\n"
            "m.version = version\n"
            "import sys, trainer3d\n"
            "print('torch' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True"]
