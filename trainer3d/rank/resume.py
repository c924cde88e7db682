"""What a stopped run tells its user: the checkpoint it saved and the command that resumes it.

A run stopped by Ctrl-C, a ``kill`` or a preemption saves a checkpoint at the next step
boundary (trainer3d/checkpoint/stop.py). Its last line then names that checkpoint and the
exact command that continues it: the command the user typed (``sys.argv`` of the submitting
process, passed to the ranks in ``TRAINER3D_COMMAND``), with ``hydra.run.dir=<run dir>``
pinned for a run without a ``name`` (its run dir is timestamped, so the same command alone
would start a new run) and any ``train.resume=`` override replaced by ``auto``. A named run
(``name=…``: run dir ``outputs/<name>``) resumes by re-running the same command. A point of a
sweep (``-m``) resumes by its own overrides, not the sweep's command (which would start every
point over in a new sweep dir): ``python -m trainer3d.train <the point's overrides>
hydra.run.dir=<the point's dir>``.
"""

import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from trainer3d.checkpoint import store
from trainer3d.checkpoint.store import checkpoint_root
from trainer3d.config.schema import Config

COMMAND_VAR = "TRAINER3D_COMMAND"
ENTRY = ["python", "-m", "trainer3d.train"]


def launch_argv(argv: Optional[Sequence[str]] = None) -> List[str]:
    """The command that started this process as a user would type it: ``python -m
    trainer3d.train ARGS`` (``sys.argv[0]`` is train.py's path under ``-m``), or the
    console script's name."""
    argv = list(sys.argv if argv is None else argv)
    return _entry(argv) + argv[1:]


def _entry(argv: Sequence[str]) -> List[str]:
    return [Path(argv[0]).name] if argv and Path(argv[0]).name == "trainer3d" else ENTRY


def resume_command(cfg: Config, argv: Optional[Sequence[str]] = None, point: Optional[Sequence[str]] = None) -> str:
    """The command that resumes ``cfg``'s run from its newest checkpoint; ``point``: the overrides
    of the sweep point ``cfg`` is (Hydra's ``overrides.task`` of the job)."""
    given = launch_argv(argv)
    if point is not None:  # the sweep's command (-m, comma lists) would start a new sweep
        given = [*_entry(list(sys.argv if argv is None else argv)), *point]
    args = [a for a in given if not a.startswith(("train.resume=", "hydra.run.dir="))]
    if not cfg.name or point is not None:
        args.append(f"hydra.run.dir={cfg.run_dir}")
    if any(a.startswith("train.resume=") for a in given):
        args.append("train.resume=auto")
    return shlex.join(args)


def remember_command(cfg: Config, point: Optional[Sequence[str]] = None) -> None:
    """Put the resume command into this process's environment, which the job's ranks inherit."""
    os.environ[COMMAND_VAR] = resume_command(cfg, point=point)


def command_for(cfg: Config) -> str:
    """The resume command: as the submitting process recorded it, else this process's own
    (a rank started in place by srun or torchrun runs the user's command itself)."""
    return os.environ.get(COMMAND_VAR) or resume_command(cfg)


def newest_checkpoint(cfg: Config) -> Optional[Path]:
    """The newest published checkpoint of the run (not verified: a stop line only names it)."""

    found = store.published(checkpoint_root(cfg))
    return found[-1][1] if found else None


def stop_line(cfg: Config, what: str) -> str:
    """``trainer3d: <what>; checkpoint <path> saved; resume with: <command>`` (one line)."""
    command = command_for(cfg)
    path = newest_checkpoint(cfg)
    if path is None:
        return f"trainer3d: {what}; no checkpoint was saved; start again with: {command}"
    return f"trainer3d: {what}; checkpoint {path} saved; resume with: {command}"
