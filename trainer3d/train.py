"""Entry point: ``python -m trainer3d.train [group=option ...] [key=value ...]``.

Hydra composes the config (``--cfg job`` prints it, ``-m`` sweeps); this module resolves
it (``model.init_from``: the model section from a Hugging Face config.json), validates it
in this process — a refused config exits with status 2 and one line per problem, before
any rank starts, as overrides Hydra cannot compose do (trainer3d/config/command_line.py) — checks the machine, the memory, the data and the run dirs the same way
(trainer3d/preflight/), and hands it to the launcher (trainer3d/launch/; in place, the rank's
task: trainer3d/rank/task.py). This process imports torch only where a check asks it (the GPU
count, the memory estimate, a checkpoint's metadata, the dry run, ``model.init_from``):
tests/unit/test_import_cost.py.
"""

import contextlib
import gc
import os
import sys
from typing import Callable, List, Optional, Sequence, Set

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
from trainer3d.config.composed import unknown_keys  # and registers the schema in the ConfigStore
from trainer3d.config.knobs import path_problems
from trainer3d.config.schema import Config
from trainer3d.config.validate import ConfigError, validate
from trainer3d.launch.local import launch_local
from trainer3d.launch.slurm import check_run_dir_free, launch_slurm
from trainer3d.preflight.refusal import refused_before_launch, report
from trainer3d.preflight.rundir import write_record
from trainer3d.rank.resume import remember_command
from trainer3d.rank.runlock import RunDirBusy, RunDirLock
from trainer3d.rank.task import TrainTask, imports_frozen, in_distributed_env, skip_exit_collection

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


def unpinned_run_dir(cfg: Config) -> Optional[str]:
    """Why ranks started in place cannot agree on the run dir, or None.

    Each rank of torchrun or an srun step runs this entry point itself, and an unnamed run's
    run dir is ``outputs/<date>/<time>`` (conf/config.yaml), read from each rank's own clock: ranks
    started across a second boundary would train into different run dirs, each a run of its own.
    So more than one rank in place needs the run dir pinned on the command line."""
    world = allocation_world_size(cfg)
    if world is None or world < 2 or cfg.name is not None or not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    given = [o.split("=", 1)[0].lstrip("+~") for o in [*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task]]
    if "hydra.run.dir" in given or "run_dir" in given:
        return None
    return (f"launcher=inplace: each of the {world} ranks started by torchrun or srun names its own run dir from "
            f"its clock (outputs/<date>/<time>), so they may not agree; give hydra.run.dir=<dir> (the same for "
            "every rank, e.g. outputs/slurm-$SLURM_JOB_ID) or name=<run name>")


def sweep_point() -> Optional[List[str]]:
    """The overrides of this sweep point (``-m``), which its resume command repeats; None outside a sweep."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return list(HydraConfig.get().overrides.task)


def run(cfg: Config, explicit_model: Sequence[str] = (), given: Optional[Set[str]] = None,
        record: Callable[[], None] = lambda: None, entry_point: bool = False) -> int:
    """Validate, prepare and launch; return the exit status. ``explicit_model``: the model
    fields given on the command line (checked against ``model.init_from``'s config.json);
    ``given``: the knobs the user set (a dry run names the sizing knobs left at defaults);
    ``record``: writes the run's record of its config, called once the run dir is the run's;
    ``entry_point``: this process is ``python -m trainer3d.train``'s, so the checks' first import
    of torch runs with the collector off and is frozen (trainer3d/rank/task.py ``imports_frozen``),
    which a caller's own process (a test's, a tool's) is left without."""
    try:
        if path_problems(cfg):  # before init_from, the resume check or any rank opens one
            raise ConfigError(path_problems(cfg))
        if cfg.model.init_from:
            from trainer3d.hf.check import apply_init_from  # imports torch (hf/mapping.py): init_from runs only
            cfg = apply_init_from(cfg, explicit_model)
        cfg = validate(cfg, allocation_world_size(cfg))
        if unpinned_run_dir(cfg):
            raise ConfigError([unpinned_run_dir(cfg)])
    except ConfigError as err:
        report("config", err.problems)
        return 2
    if not check_resume(cfg):
        return 2
    if cfg.dry_run:
        from trainer3d.memory.dry_run import print_plan  # builds the model on the meta device: imports torch
        print_plan(cfg, defaults_block(cfg, given))
        try:  # the record of what was planned, unless another run owns the run dir (its record stays)
            RunDirLock.for_run(cfg).check_free()
            record()
        except RunDirBusy:
            pass
        return 0
    freeze = entry_point and gc.get_freeze_count() == 0  # once a process: a sweep's later points find it done
    with imports_frozen() if freeze else contextlib.nullcontext():  # the device and memory checks import torch
        refused = refused_before_launch(cfg)  # extras, devices, memory, data, run dirs (trainer3d/preflight/)
    if refused:
        return 2
    remember_command(cfg, sweep_point())  # the ranks' stop line prints it (trainer3d/rank/resume.py)
    return launch(cfg, record)


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


def launch(cfg: Config, record: Callable[[], None] = lambda: None) -> int:
    """Start the ranks of a validated config: in place (already one rank of an allocation), as
    a Slurm job, or as local processes; return the exit status. ``record`` (the config's record
    in the run dir) is written only once no other run holds the run dir: a local run writes it
    under its lock; elsewhere the lock is checked free first (rank 0 of an allocation writes it)."""
    try:
        if cfg.launcher.name == "inplace" or in_distributed_env():
            if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
                RunDirLock.for_run(cfg).check_free()
                record()
            TrainTask(cfg)()
            return 0
        if cfg.launcher.name == "slurm":
            check_run_dir_free(cfg)
            record()
            return launch_slurm(cfg)
    except RunDirBusy as err:
        print(f"trainer3d: {err}", file=sys.stderr, flush=True)
        return 2
    return launch_local(cfg, record)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _main(dcfg: DictConfig) -> int:
    unknown = report("config", unknown_keys(dcfg))  # what a +key=value added: to_object would drop it silently
    hydra_cfg = HydraConfig.get()
    status = 2 if unknown else run(resolve(dcfg), explicit_model_fields(), given_knobs(),
                                   lambda: write_record(dcfg, hydra_cfg), entry_point=True)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return status  # one failed point must not end the sweep: trainer3d/launch/sweep.py reports them all
    if status:
        sys.exit(status)
    return status


def main() -> None:
    skip_exit_collection()
    if wants_help(sys.argv[1:]):  # every knob with its default, range and docstring (Hydra's page lists groups only)
        print_help("python -m trainer3d.train", "config", Config, sys.argv[1:])
        sys.exit(0)  # as argparse's --help
    refuse_bad_overrides("config", sys.argv[1:])  # one line and exit 2, where Hydra's own refusal is a page and 1
    _main()


if __name__ == "__main__":
    main()
