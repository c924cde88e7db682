"""Run the engine itself on a layout and read back its step times.

``--calibrate`` runs it at a negligible model size, where a step is nothing but the host's
and the collectives' fixed costs (calibrate.py fits them); tools/bench/plan_accuracy.py runs it at
a real size and compares with the prediction. Each run is ``python -m trainer3d.train`` with
Hydra overrides (local ranks, gloo, wandb off), its step times read from metrics.jsonl.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.rows import read_metrics
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate

ROOT = Path(__file__).resolve().parents[2]


def training_config(overrides: Sequence[str]) -> Config:
    """The validated config ``python -m trainer3d.train <overrides>`` would run."""
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        dcfg = compose("config", [*overrides, "run_dir=.", "launcher.folder=."])
    return validate(OmegaConf.to_object(dcfg))


def measured_step_s(overrides: Sequence[str], steps: int, warmup: int, run_dir: Path,
                    env: Optional[Mapping[str, str]] = None) -> List[float]:
    """``step_time_s`` of every step after the first ``warmup`` of a ``steps``-step run
    (``env``: variables set for the run beside this process's)."""
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides,
           f"train.max_steps={steps}", "train.log_every=1", "checkpoint.save_final=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "WANDB_MODE": "disabled", **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows, _ = read_metrics(Path(run_dir) / "metrics.jsonl")
    return [r["step_time_s"] for r in rows[warmup:]]
