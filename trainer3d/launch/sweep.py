"""Sweeps (``python -m trainer3d.train -m parallel.dp=1,2 ...``): one job per point, one report.

Hydra's basic launcher runs the points one after another in this process, each through
the ordinary entry point, so each is validated here and gets its own run dir (the sweep's
``<sweep dir>/<n>``: metrics.jsonl, submitit/, slurm_job.json). With ``launcher=slurm`` a
point only submits its job (``trainer3d.launch.slurm.defer_follow``), so the jobs run side by side
on the cluster; this callback, registered in conf/config.yaml, then follows them one by
one if ``launcher.wait=true`` and prints one line per point. A point that fails (a config
error, a refused submission, a failed job) does not stop the others; the sweep exits with
the worst status.

Why not hydra-submitit-launcher: it submits the sweep as one Slurm array with one set of
sbatch parameters, but a sweep over parallel.dp or tp changes the number of tasks per
point; it would also bypass this project's launcher settings, validation and requeue cap.
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer3d.launch.slurm import follow_slurm, load_job


@dataclass
class Point:
    num: int
    overrides: str
    run_dir: Path
    status: int
    note: str
    follow: bool
    job_id: Optional[str] = None


class SweepReport(Callback):
    def __init__(self) -> None:
        self.points: List[Point] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.points = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra_cfg = config.hydra if "hydra" in config else HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return
        if job_return.status == JobStatus.COMPLETED:
            status, note = int(job_return._return_value or 0), ""
        else:  # an exception escaped the entry point (e.g. a config that does not compose)
            err = job_return._return_value
            status, note = 1, f"{type(err).__name__}: {err}"
        launcher = config.get("launcher", {})
        self.points.append(Point(
            num=int(hydra_cfg.job.num), overrides=" ".join(job_return.overrides or []) or "(no overrides)",
            run_dir=Path(hydra_cfg.runtime.output_dir), status=status, note=note,
            follow=launcher.get("name") == "slurm" and bool(launcher.get("wait"))))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        for point in self.points:
            record = point.run_dir / "slurm_job.json"
            if point.status == 0 and record.exists():
                job = load_job(record)
                point.job_id = job.job_id
                if point.follow:
                    print(f"\ntrainer3d: sweep point #{point.num}: following job {job.job_id} ({point.run_dir})",
                          flush=True)
                    point.status = follow_slurm(job, float(config.parallel.timeout_s), point.run_dir)
        worst = self.report()
        if worst:
            sys.exit(worst)

    def report(self) -> int:
        common = set.intersection(*(set(p.overrides.split()) for p in self.points)) if self.points else set()
        print(f"\ntrainer3d: sweep of {len(self.points)} point(s)"
              + (f" (all with {' '.join(sorted(common))})" if common else "") + ":", flush=True)
        for p in self.points:
            varying = " ".join(o for o in p.overrides.split() if o not in common) or p.overrides
            job = f"job {p.job_id}" if p.job_id else ""
            if p.status == 0:
                state = "submitted" if p.job_id and not p.follow else "ok"
            else:
                state = {2: "refused (exit 2): its error is above"}.get(p.status, f"failed (exit {p.status})")
            detail = p.note or (str(p.run_dir / "metrics.jsonl") if p.status == 0 else str(p.run_dir))
            print(f"  #{p.num} {varying}: {' '.join(x for x in (job, state) if x)} - {detail}", flush=True)
        return max((p.status for p in self.points), default=0)
