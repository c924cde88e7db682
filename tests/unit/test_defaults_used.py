"""A dry run names the knobs sizing memory and time that the command and its recipe left at
their defaults (trainer3d/config/defaults_used.py): only those, with their values."""

import subprocess
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, ROOT
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.defaults_used import SIZING, defaults_used, given_keys, recipe_keys
from trainer3d.config.validate import validate


def _used(overrides, recipe=None):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose("config", [*overrides, *([f"experiment={recipe}"] if recipe else []),
                                  "run_dir=/tmp/x", "launcher.folder=/tmp/x"])
    cfg = validate(OmegaConf.to_object(dcfg), 64 if recipe else None)
    return defaults_used(cfg, given_keys(overrides, recipe_keys(CONF_DIR, recipe) if recipe else ()))


def test_a_large_model_on_the_defaults_names_its_tiny_sequence_and_fp32():
    used = _used(["model=70b"])
    assert "train.seq_len=128" in used and "train.dtype=fp32" in used
    assert "parallel.tp=2" in used and not any(u.startswith("model=") for u in used)
    assert not any(u.startswith("train.grad_accum_steps=") for u in used)  # derived, not a default


def test_what_the_command_line_sets_is_not_listed():
    used = _used(["model=7b", "parallel.pp=1", "train.seq_len=512", "train.dtype=bf16"])
    assert "parallel.tp=2" in used and "parallel.dp=2" in used  # the default group's, still defaults
    assert not [u for u in used if u.split("=")[0] in ("parallel.pp", "train.seq_len", "train.dtype")]
    assert "model" not in {u.split("=")[0] for u in _used(["model.dim=256"])}
    assert not [u for u in _used(["parallel=dp2"]) if u.startswith("parallel.")]  # the group chosen


def test_what_a_recipe_sets_is_not_listed():
    used = _used(["data.path=/data/web.bin"], recipe="llama3.1-70b-64gpu")
    assert used == ["train.activation_checkpointing=false"]  # the recipe sets every other one
    assert set(SIZING) >= {u.split("=")[0] for u in _used([])}


def test_the_dry_run_prints_the_block(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer3d.train", "dry_run=true", "model=70b",
                           "train.dtype=bf16", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = lines.index("defaults used (set on the command line to change; they size memory and time):")
    block = " ".join(lines[at + 1:at + 3])
    assert "train.seq_len=128" in block and "train.micro_batch_size=8" in block and "train.dtype" not in block
