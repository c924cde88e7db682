"""Metric sinks beyond metrics.jsonl and the console: wandb and TensorBoard.

One wandb run per training run, opened by rank 0 only. Its id is kept in the run dir
(``wandb_run_id``), so a Slurm requeue — same run dir — resumes the same wandb run instead
of starting another. Offline by default: no key and no network needed, ``wandb sync`` later.
"""

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Iterable, Optional

from trainer3d.config.schema import Config, flatten
from trainer3d.config.secrets import scrub
from trainer3d.config.validate import layout_of
from trainer3d.config.extras import require


def wandb_mode(logger_mode: str, environ=os.environ) -> str:
    """auto: $WANDB_MODE if set, else online when $WANDB_API_KEY is set, else offline."""
    if logger_mode != "auto":
        return logger_mode
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def _run_id(run_dir: Path) -> str:
    path = run_dir / "wandb_run_id"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n")
    return run_id


class WandbLogger:
    """Rank 0's wandb run: the resolved config and layout once, then one entry per step."""

    def __init__(self, cfg: Config):
        import wandb  # optional and slow to import: only runs that log to wandb pay for it

        run_dir = self.run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        lc = cfg.logger
        self.mode = wandb_mode(lc.mode)
        config = scrub(dataclasses.asdict(cfg))
        config["layout"] = layout_of(cfg)
        self.run = wandb.init(project=lc.project, entity=lc.entity, group=lc.group, tags=list(lc.tags) or None,
                              name=lc.run_name or run_dir.name, id=_run_id(run_dir), resume="allow",
                              dir=str(run_dir), mode=self.mode, config=config)

    def log(self, rows: Iterable[dict]) -> None:
        for row in rows:
            self.run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def summary(self, values: dict) -> None:
        """The run's end-of-training figures (goodput against the prediction: observe/goodput.py)."""
        self.run.summary.update({f"goodput/{k}": v for k, v in flatten(values).items()})

    def close(self) -> None:
        self.run.finish()
        hint = sync_hint(self.run_dir) if self.mode == "offline" else None
        if hint:
            print(f"wandb: offline run saved; to upload it: {hint}", flush=True)


class TensorBoardLogger:
    """Rank 0's TensorBoard event files in ``<run_dir>/tensorboard``: every numeric column of a
    metrics row as a scalar at its step, stamped with the row's wall-clock ``time``. A resumed
    run appends a new event file to the same directory; TensorBoard reads them as one run."""

    def __init__(self, cfg: Config):
        require("tensorboard", "logger=tensorboard")  # checked before launch too (trainer3d/train.py)
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.dir = Path(cfg.run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("config", "```\n" + json.dumps(scrub(dataclasses.asdict(cfg)), indent=1) + "\n```")

    def log(self, rows: Iterable[dict]) -> None:
        for row in rows:
            for key, value in row.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, global_step=row["step"], walltime=row.get("time"))
        self.writer.flush()

    def summary(self, values: dict) -> None:
        """The run's summary (goodput against the prediction) as a text panel."""
        self.writer.add_text("summary", "```\n" + json.dumps(values, indent=1) + "\n```")

    def close(self) -> None:
        self.writer.close()
        print(f"tensorboard: event files in {self.dir}; to view them: tensorboard --logdir {self.dir.parent}",
              flush=True)


def build_sinks(cfg: Config) -> list:
    """The extra metric sinks rank 0 writes to (empty for logger=console)."""
    if cfg.logger.name == "wandb" and wandb_mode(cfg.logger.mode) != "disabled":
        return [WandbLogger(cfg)]
    if cfg.logger.name == "tensorboard":
        return [TensorBoardLogger(cfg)]
    return []


def offline_run_dirs(run_dir: Path) -> list:
    """This run's offline wandb directories (what `wandb sync` takes)."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))


def sync_hint(run_dir: Path) -> Optional[str]:
    dirs = offline_run_dirs(run_dir)
    return f"wandb sync {dirs[-1]}" if dirs else None
