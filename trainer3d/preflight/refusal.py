"""The checks a run passes before any rank starts, in the submitting process, and how a
refusal reads: one line per problem, ``trainer3d: <kind> error: <problem>`` on stderr, naming
the knob or file and the fix, then exit status 2 (the entry point's, trainer3d/train.py).

The checks run in order and the first that finds problems ends the run: the optional
packages a config names, the machine's devices (trainer3d/config/device.py), the memory
estimate (``memory_check``), the data (``data_checks``), the directories the ranks write
(``rundir``). Each is cheap before the next: a run on the wrong device is not costed.
"""

import sys
from typing import Callable, List, Sequence, Tuple

from trainer3d.config.device import machine_problems
from trainer3d.config.extras import EXTRAS, missing
from trainer3d.config.schema import Config
from trainer3d.config.validate import world_size_of
from trainer3d.preflight.data_checks import check_data
from trainer3d.preflight.rundir import directory_problems


def report(kind: str, problems: Sequence[str]) -> bool:
    """Print ``problems`` as refusals of ``kind`` (config, device, memory, data, run dir);
    True when there was one."""
    for problem in problems:
        print(f"trainer3d: {kind} error: {problem}", file=sys.stderr)
    return bool(problems)


def extras_problems(cfg: Config) -> List[str]:
    """The sink ``logger=`` names, checked here before any rank imports it."""
    problem = missing(cfg.logger.name, f"logger={cfg.logger.name}") if cfg.logger.name in EXTRAS else None
    return [problem] if problem else []


def estimate_problems(cfg: Config) -> List[str]:
    """``memory_check``'s refusal. It builds a block of the model on the meta device, so it
    imports torch (and the model, the parallel layers): only a run past the config, resume and
    device checks pays for that; ``--help``, ``--cfg job``, a refused config and a run without the
    check (``launcher.check_memory=false``, not the local launcher) import no torch here."""
    if not cfg.launcher.check_memory or cfg.launcher.name != "local":
        return []  # the one place that decides whether the check runs, before its import
    from trainer3d.preflight.memory_check import memory_problems  # imports torch: see above
    return memory_problems(cfg, world_size_of(cfg))


CHECKS: Tuple[Tuple[str, Callable[[Config], List[str]]], ...] = (
    ("config", extras_problems),
    ("device", lambda cfg: machine_problems(cfg, world_size_of(cfg))),
    ("memory", estimate_problems),
    ("data", check_data),  # also a data vocabulary or id the model (init_from's included) cannot embed
    ("run dir", directory_problems),
)


def refused_before_launch(cfg: Config) -> bool:
    """Run ``CHECKS`` in order on a validated config; the first with problems reports them
    and the run is refused (True)."""
    return any(report(kind, check(cfg)) for kind, check in CHECKS)
