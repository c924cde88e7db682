"""The layout planner: ``python -m trainer3d.plan model=7b cluster.nodes=16 cluster.gpus_per_node=8
cluster.gpu=h100-sxm train.global_batch_size=1024 train.seq_len=4096``.

Hydra composes the training schema plus ``cluster.*`` and ``search.*`` (conf/plan.yaml);
the planner prints the search's summary, the fastest layouts that fit with their predicted
peak memory and step time, and each one's ``python -m trainer3d.train`` command.
``plan.evaluate=true`` evaluates the overrides' own layout instead (trainer3d/plan/evaluate.py).
``python -m trainer3d.plan --calibrate [--out FILE] [--max-ranks N] [--quick]`` measures this machine instead and
writes the file ``cluster.gpu=calibrated`` reads.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer3d.config.command_line import refuse_bad_overrides
from trainer3d.config.conf_dir import CONF_DIR
from trainer3d.config.help import print_help, wants_help
from trainer3d.config.validate import ConfigError
from trainer3d.plan.calibrate import main as calibrate_main
from trainer3d.plan.evaluate import LayoutError, evaluate_report
from trainer3d.plan.knobs import plan_problems
from trainer3d.plan.composed import PlanConfig  # registers the schema in the ConfigStore
from trainer3d.plan.devices import device_for
from trainer3d.plan.report import report
from trainer3d.plan.search import search


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="plan")
def _main(dcfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(dcfg)
    problems = plan_problems(cfg)
    if problems:  # before the search divides by them
        print("\n".join(f"trainer3d.plan: {p}" for p in problems), file=sys.stderr)
        sys.exit(2)
    try:
        device = device_for(cfg.cluster.gpu, cfg.cluster.calibration)
    except (ValueError, FileNotFoundError) as err:
        print(f"trainer3d.plan: {err}", file=sys.stderr)
        sys.exit(2)
    if cfg.plan.evaluate:
        try:
            print(evaluate_report(cfg, device)[0])
        except (LayoutError, ConfigError) as err:
            print(f"trainer3d.plan: {err}", file=sys.stderr)
            sys.exit(2)
        return
    print(report(cfg, device, search(cfg, device), HydraConfig.get().overrides.task))


def main() -> None:
    if "--calibrate" in sys.argv:
        calibrate_main(sys.argv[1:])
        return
    if wants_help(sys.argv[1:]):
        print_help("python -m trainer3d.plan", "plan", PlanConfig, sys.argv[1:])
        sys.exit(0)  # as argparse's --help
    refuse_bad_overrides("plan", sys.argv[1:])  # one line and exit 2 (trainer3d/config/command_line.py)
    _main()


if __name__ == "__main__":
    main()
