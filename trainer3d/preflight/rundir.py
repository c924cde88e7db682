"""The run dir before anything writes to it: a Hydra callback, registered in conf/config.yaml.

Hydra creates the run dir (``hydra.run.dir``; the sweep's ``hydra.sweep.dir`` with ``-m``)
and writes ``.hydra/`` into it before the entry point runs, so a run dir on a full disk, on
a read-only mount, or under a path that is a file fails inside Hydra with a traceback, and
one that fills up later fails inside a rank. ``on_run_start`` / ``on_multirun_start`` run
before Hydra touches the directory: here it is created and a probe file is written and
synced (a full file system refuses the data block even where it still has inodes for an
empty file), then removed. A refusal is one line naming the directory, the reason and the
knob, and the process exits with status 2, as for any refused config.

``write_record`` writes the run's record of its config, ``.hydra/`` (``config.yaml``,
``hydra.yaml``, ``overrides.yaml``, as Hydra writes them; conf/config.yaml turns Hydra's own
writer off), through ``scrub`` (trainer3d/config/secrets.py): a token in any config string
(``launcher.setup=["export HF_TOKEN=hf_..."]``) never reaches the disk, and one line says
what was redacted. The job itself runs with the values given. The entry point calls it once
the run holds its run dir's lock (trainer3d/train.py), never from a Hydra callback: a second
start refused beside a running run must leave the running run's record as it was.
"""

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, List, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from trainer3d.config.knobs import name_problem
from trainer3d.config.schema import Config
from trainer3d.config.secrets import redaction_line, scrub

RECORD_DIR = ".hydra"
PROBE_BYTES = 64 * 1024
"""What the probe writes: more than a file system's block, less than any run's first file."""


def write_problem(directory: Path) -> Optional[str]:
    """Why ``directory`` cannot hold a run's files (created if missing), or None."""
    directory = Path(directory)
    too_long = name_problem(str(directory))
    if too_long:
        return f"{directory} {too_long}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".trainer3d-probe-", dir=directory)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and Path(err.filename) != directory else ""
        return f"{directory} cannot be written{where}: {err.strerror or err}"
    return None


def directory_problems(cfg: Config) -> List[str]:
    """The directories the ranks write (run dir, checkpoints, launcher logs), each created and
    probed with a synced write (``write_problem``): a full or unwritable one is one line before
    launch, not a traceback in a rank."""
    knobs = {"run_dir": cfg.run_dir, "checkpoint.dir": cfg.checkpoint.dir, "launcher.folder": cfg.launcher.folder}
    problems = []
    for knob, value in knobs.items():
        problem = write_problem(Path(value).expanduser()) if value else None
        if problem:
            problems.append(f"{knob}: {problem}; free space or fix its permissions, or point {knob} elsewhere")
    return problems


def refuse_unwritable(directory: Path, knob: str) -> None:
    """Exit with status 2 and one line if ``directory`` cannot be written."""
    problem = write_problem(directory)
    if problem:
        print(f"trainer3d: run dir error: {problem}; free space or fix its permissions, or give another "
              f"{knob}=...", file=sys.stderr, flush=True)
        raise SystemExit(2)


class RunDirCheck(Callback):
    """Refuses a run dir (or sweep dir) that cannot be written, before Hydra writes to it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(Path(str(config.hydra.run.dir)), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(Path(str(config.hydra.sweep.dir)), "hydra.sweep.dir")


def write_record(config: DictConfig, hydra: DictConfig) -> None:
    """``<run dir>/.hydra/{config,hydra,overrides}.yaml`` with credentials redacted: ``config``
    the task's composed config, ``hydra`` Hydra's own node (``HydraConfig.get()``)."""
    directory = Path(str(hydra.runtime.output_dir)) / (hydra.output_subdir or RECORD_DIR)
    found: list = []
    task = {k: v for k, v in OmegaConf.to_container(config, resolve=False).items() if k != "hydra"}
    records = {"config.yaml": scrub(task, found),
               "hydra.yaml": scrub({"hydra": OmegaConf.to_container(hydra, resolve=False)}),
               "overrides.yaml": scrub(OmegaConf.to_container(hydra.overrides.task, resolve=False), found, "override")}
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in records.items():
        (directory / name).write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    line = redaction_line(found, f"{directory}, checkpoint markers and wandb")
    if line:
        print(line, file=sys.stderr, flush=True)
