"""The run's typed configuration.

Every knob lives in one of these dataclasses, registered in Hydra's ConfigStore as the
schema (by trainer3d/config/composed.py, where the config is composed); the YAML files in ``conf/`` only select a group member and override values, so a
typo or a wrong type is refused by Hydra before anything runs. Cross-field rules (batch
arithmetic, divisibility, ZeRO with pipelining) are checked by ``trainer3d.config.validate``.
Each section lives in a module of its own: ``schema_model`` (``model.*``), ``schema_parallel``
(``parallel.*``), ``schema_train`` (``train.*``, ``optim.*``) and ``schema_run`` (``data.*``,
``launcher.*``, ``logger.*``, ``checkpoint.*``); this module joins them into ``Config``,
re-exports them, so ``trainer3d.config.schema`` names every class of the schema.

It imports neither Hydra nor OmegaConf: a rank unpickles its ``Config`` from this module
(trainer3d/rank/task.py) and composes nothing, so it pays for neither
(tests/unit/test_import_cost.py); trainer3d/config/composed.py registers the schema with
Hydra for every place that composes.
"""

import re
from dataclasses import dataclass, field
from typing import Optional

from trainer3d.config.schema_model import ModelConfig, MoEConfig, RopeScalingConfig
from trainer3d.config.schema_parallel import ParallelConfig
from trainer3d.config.schema_run import BlendSource, CheckpointConfig, DataConfig, LauncherConfig, LoggerConfig
from trainer3d.config.schema_train import (InjectConfig, MuonConfig, OptimConfig, SpikeConfig, StragglerConfig,
                                           TrainConfig)

__all__ = [
    "BlendSource", "CheckpointConfig", "Config", "DataConfig", "InjectConfig", "LauncherConfig", "LoggerConfig",
    "ModelConfig", "MoEConfig", "MuonConfig", "OptimConfig", "ParallelConfig", "RUN_NAME", "RopeScalingConfig",
    "SpikeConfig", "StragglerConfig", "TrainConfig",
    "flatten", "named_run_dir",
]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    name: Optional[str] = None
    """A named run (letters, digits, ``.``, ``_``, ``-``): its run dir is ``outputs/<name>``
    instead of a timestamped one, so the same command run again resumes it from its newest
    checkpoint (train.resume=auto); also wandb's run name unless logger.run_name is set."""
    run_dir: str = "${hydra:runtime.output_dir}"
    """Where metrics.jsonl, checkpoints and logs of this run go."""
    dry_run: bool = False
    """Validate and print the rank layout and memory plan, start nothing."""


RUN_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")


def flatten(values: dict, prefix: str = "") -> dict:
    """A nested record (a config's ``asdict``, a run summary) with dotted keys, prefixed:
    ``{"model": {"dim": 64}}`` -> ``{"model.dim": 64}``."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def named_run_dir(name: Optional[str], default: str) -> str:
    """``hydra.run.dir`` (conf/config.yaml): ``outputs/<name>`` for a named run, else ``default``
    (also for a malformed name, which validate refuses in one line: an exception raised while
    Hydra resolves its run dir would reach the user as a page of traceback)."""
    return f"outputs/{name}" if name is not None and RUN_NAME.match(str(name)) else default
