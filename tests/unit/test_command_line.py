"""Every refusal of a command line is one line and exit status 2, an unknown key names the
nearest known ones (trainer3d/config/command_line.py), alike for ``python -m trainer3d.train``,
``python -m trainer3d.plan`` and the parity tool. Hydra's own refusal of the same command line
is a multi-line page ending in its HYDRA_FULL_ERROR hint, with exit status 1."""

import subprocess
import sys

import pytest

TRAIN = [sys.executable, "-m", "trainer3d.train"]
PLAN = [sys.executable, "-m", "trainer3d.plan"]
PARITY = [sys.executable, "-m", "trainer3d.tools.parity"]


def _refusal(cmd, tmp_path):
    out = subprocess.run([*cmd], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    assert lines[0].startswith("trainer3d: config error: ") and "HYDRA_FULL_ERROR" not in out.stderr
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run directory
    return lines[0]


@pytest.mark.parametrize("cmd, wanted", [
    ([*TRAIN, "optim.lrr=1e-3"], "optim.lrr is not a knob of this config; did you mean optim.lr"),
    ([*TRAIN, "-m", "train.max_stepz=3,4"], "train.max_stepz is not a knob of this config; did you mean train.max_steps"),
    ([*TRAIN, "parallel=tp3"], "parallel=tp3 is not an option of parallel; the options are: dp2, single, tp2-pp2-dp2"),
    ([*TRAIN, "train.max_steps=abc"], "train.max_steps=abc is refused: train.max_steps takes an integer"),
    ([*TRAIN, "optim.lr=fast"], "optim.lr=fast is refused: optim.lr takes a number"),
    ([*PLAN, "cluster.gpuz=h100"], "cluster.gpuz is not a knob of this config; did you mean cluster.gpu"),
    ([*PLAN, "parallel=tp3"], "parallel=tp3 is not an option of parallel"),
    ([*PARITY, "parallel.tpp=2", "--out", "parity"], "layout A: parallel.tpp is not a knob of this config; "
                                                     "did you mean parallel.tp"),
])
def test_a_command_line_refusal_is_one_line_with_exit_2_and_a_suggestion(cmd, wanted, tmp_path):
    assert wanted in _refusal(cmd, tmp_path)


def test_hydras_own_refusal_of_the_same_key_is_a_page_with_exit_1(tmp_path):
    """The reference the one line replaces: Hydra itself, through its compose API's run."""
    code = ("import sys; from hydra import main; from trainer3d.config.schema import Config\n"
            "from trainer3d.config.conf_dir import CONF_DIR\n"
            "main(version_base=None, config_path=str(CONF_DIR), config_name='config')(lambda cfg: None)()")
    out = subprocess.run([sys.executable, "-c", code, "optim.lrr=1e-3"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and "HYDRA_FULL_ERROR" in out.stderr and len(out.stderr.strip().splitlines()) > 1
