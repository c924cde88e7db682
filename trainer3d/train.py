"""Entry point: ``python -m trainer3d.train [group=option ...] [key=value ...]``.

Hydra composes the config (``--cfg job`` prints it, ``-m`` sweeps); this module resolves
it (``model.init_from``: the model section from a Hugging Face config.json), validates it
in this process — a refused config exits with status 2 and one line per problem, before
any rank starts, as overrides Hydra cannot compose do (trainer3d/config/command_line.py) — checks the machine, the memory, the data and the run dirs the same way
(trainer3d/preflight/), and hands it to the launcher (trainer3d/launch/; in place, the rank's
body: trainer3d/rank/task.py).
"""

import os
import sys
from typing import List, Optional, Sequence, Set

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer3d.checkpoint.choose import choose
from trainer3d.checkpoint.store import CheckpointError, checkpoint_root
from trainer3d.config.command_line import refuse_bad_overrides
from trainer3d.config.conf_dir import CONF_DIR
from trainer3d.config.defaults_used import defaults_block, given_keys, recipe_keys
from trainer3d.config.help import print_help, wants_help
from trainer3d.config.knobs import path_problems, unknown_keys
from trainer3d.config.schema import Config  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.validate import ConfigError, validate
from trainer3d.hf.check import apply_init_from
from trainer3d.launch.local import launch_local
from trainer3d.launch.slurm import launch_slurm
from trainer3d.memory.dry_run import print_plan
from trainer3d.preflight.refusal import refused_before_launch, report
from trainer3d.rank.resume import remember_command
from trainer3d.rank.task import TrainTask, in_distributed_env

def resolve(dcfg: DictConfig) -> Config:
    """The composed config as plain dataclasses, interpolations resolved (picklable).

    In a sweep (``-m``) every point's wandb run joins one group, named after the sweep's
    directory, unless ``logger.group`` is set; a named run (``name=``) is wandb's run name
    unless ``logger.run_name`` is set.
    """
    cfg = OmegaConf.to_object(dcfg)
    if cfg.logger.group is None and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        cfg.logger.group = os.path.basename(os.path.normpath(HydraConfig.get().sweep.dir))
    if cfg.logger.run_name is None and cfg.name is not None:
        cfg.logger.run_name = cfg.name
    return cfg


def explicit_model_fields() -> List[str]:
    """The model fields set on the command line (``model.dim=256`` -> ``dim``), which
    ``model.init_from`` must agree with; group choices (``model=7b``) are not among them."""
    if not HydraConfig.initialized():
        return []
    fields = []
    for override in HydraConfig.get().overrides.task:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("model."):
            fields.append(key[len("model."):])
    return fields


def allocation_world_size(cfg: Config):
    """World size fixed by an existing allocation (in-place launch), else None."""
    if cfg.launcher.name == "inplace" or in_distributed_env():
        return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    return None


def given_knobs() -> Optional[Set[str]]:
    """The keys and groups the command line and its recipe set (trainer3d/config/defaults_used.py),
    or None where that is unknown (no Hydra run, a recipe from outside conf/)."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    recipe = hydra_cfg.runtime.choices.get("experiment")
    keys = recipe_keys(CONF_DIR, recipe) if recipe else []
    return None if keys is None else given_keys(hydra_cfg.overrides.task, keys)


def run(cfg: Config, explicit_model: Sequence[str] = (), given: Optional[Set[str]] = None) -> int:
    """Validate, prepare and launch; return the exit status. ``explicit_model``: the model
    fields given on the command line (checked against ``model.init_from``'s config.json);
    ``given``: the knobs the user set (a dry run names the sizing knobs left at defaults)."""
    try:
        if cfg.model.init_from:
            cfg = apply_init_from(cfg, explicit_model)
        cfg = validate(cfg, allocation_world_size(cfg))
        if path_problems(cfg):
            raise ConfigError(path_problems(cfg))
    except ConfigError as err:
        report("config", err.problems)
        return 2
    if not check_resume(cfg):
        return 2
    if cfg.dry_run:
        print_plan(cfg, defaults_block(cfg, given))
        return 0
    if refused_before_launch(cfg):  # extras, devices, memory, data, run dirs (trainer3d/preflight/)
        return 2
    remember_command(cfg)  # the ranks' stop line prints it (trainer3d/rank/resume.py)
    return launch(cfg)


def check_resume(cfg: Config) -> bool:
    """The checkpoint the run will resume from, checked here before launch (checksums, model):
    a refusal is one line; newer checkpoints ``auto`` passes over are named on this console.
    Ranks of an existing allocation (in place) leave it to rank 0, as every rank runs this."""
    if cfg.launcher.name == "inplace" or in_distributed_env():
        return True
    try:
        choice = choose(cfg, checkpoint_root(cfg))
    except CheckpointError as err:
        report("config", [str(err)])
        return False
    for path, why in choice.skipped if choice else ():
        print(f"trainer3d: train.resume=auto: skipping checkpoint {path}: {why}", file=sys.stderr, flush=True)
    if choice is not None and choice.skipped:
        print(f"trainer3d: train.resume=auto: resuming from the newest good checkpoint, {choice.path}",
              file=sys.stderr, flush=True)
    return True


def launch(cfg: Config) -> int:
    """Start the ranks of a validated config: in place (already one rank of an allocation), as
    a Slurm job, or as local processes; return the exit status."""
    if cfg.launcher.name == "inplace" or in_distributed_env():
        TrainTask(cfg)()
        return 0
    if cfg.launcher.name == "slurm":
        return launch_slurm(cfg)
    return launch_local(cfg)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _main(dcfg: DictConfig) -> int:
    unknown = report("config", unknown_keys(dcfg))  # what a +key=value added: to_object would drop it silently
    status = 2 if unknown else run(resolve(dcfg), explicit_model_fields(), given_knobs())
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return status  # one failed point must not end the sweep: trainer3d/launch/sweep.py reports them all
    if status:
        sys.exit(status)
    return status


def main() -> None:
    if wants_help(sys.argv[1:]):  # every knob with its default, range and docstring (Hydra's page lists groups only)
        print_help("python -m trainer3d.train", "config", Config, sys.argv[1:])
        sys.exit(0)  # as argparse's --help
    refuse_bad_overrides("config", sys.argv[1:])  # one line and exit 2, where Hydra's own refusal is a page and 1
    _main()


if __name__ == "__main__":
    main()
