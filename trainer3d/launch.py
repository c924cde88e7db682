"""Start the ranks: through submitit (local processes or a Slurm job), or in place.

The submitting process validates the config, prepares the data, submits ``TrainTask`` and
follows the job: it echoes rank 0's progress lines, and if any rank fails it cancels the
others and shows the failing rank's traceback. Inside each task, submitit's
``TorchDistributedEnvironment`` exports MASTER_ADDR/PORT, RANK and WORLD_SIZE, and the
process group starts with an explicit timeout, so a dead peer ends the job instead of
hanging it for gloo's default 30 minutes.
"""

import datetime
import os
import pickle
import sys
import time
from pathlib import Path
from typing import List, Optional

import submitit
import torch
import torch.distributed as dist

from trainer3d.config import Config

POLL_S = 0.5


# --------------------------------------------------------------------------- inside a rank

def in_distributed_env() -> bool:
    """True when this process is already one rank of an allocation (torchrun, or an srun step)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                 and "MASTER_ADDR" in os.environ):
        return True
    submitit_task = any(k.startswith("SUBMITIT_") for k in os.environ)
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1 and not submitit_task


def init_distributed(cfg: Config) -> torch.device:
    """Initialise the default process group from the environment; return this rank's device."""
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        # Ranks share the host's cores; without this each one starts a full-size thread pool.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s),
                                device_id=device if use_cuda else None)
    return device


def run_rank(cfg: Config):
    """The body of every rank: process group, layout, trainer. Returns rank 0's summary."""
    from trainer3d.topology import ParallelDims, Topology
    from trainer3d.trainer import Trainer

    from trainer3d.preemption import leave

    device = init_distributed(cfg)
    try:
        p = cfg.parallel
        dims = ParallelDims.build(Topology(tp=p.tp, pp=p.pp, dp=p.dp), device, cfg.model.tie_embeddings)
        trainer = Trainer(cfg, dims)
        summary = trainer.train()
        if trainer.stopped is not None:  # SIGUSR2/SIGTERM: every rank stopped at the same step
            leave(trainer.stopped, trainer.stop_signal, dims.rank)
        return summary
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def export_rank_env() -> None:
    """Set torch.distributed's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_*).

    A submitit task (local or Slurm): from submitit's TorchDistributedEnvironment, replacing
    what a parent job left. torchrun (or anyone who set RANK/WORLD_SIZE/MASTER_ADDR): kept.
    A task of a plain ``srun`` step (slurm/train.sbatch): the same TorchDistributedEnvironment
    over Slurm's variables (SLURM_PROCID, SLURM_NTASKS, ...) — submitit recognises a Slurm
    job only by SUBMITIT_EXECUTOR, which srun does not set, so it is set here.
    """
    if "SUBMITIT_EXECUTOR" not in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
            return
        if "SLURM_STEP_ID" not in os.environ or "SLURM_PROCID" not in os.environ:
            raise RuntimeError("launcher=inplace needs to run inside an srun step or under torchrun "
                               "(RANK, WORLD_SIZE, MASTER_ADDR unset); use launcher=local to start the ranks here")
        os.environ["SUBMITIT_EXECUTOR"] = "slurm"
    submitit.helpers.TorchDistributedEnvironment().export(overwrite=True)


class TrainTask:
    """What submitit runs on every task. Picklable: it holds the resolved config and how many
    times the job was requeued (the cap is launcher.max_requeues)."""

    def __init__(self, cfg: Config, requeues: int = 0):
        self.cfg = cfg
        self.requeues = requeues

    def __call__(self):
        export_rank_env()
        return run_rank(self.cfg)

    def checkpoint(self, *args, **kwargs) -> Optional[submitit.helpers.DelayedSubmission]:
        """submitit's requeue hook, run on rank 0 once every rank has stopped at the same step and
        saved (trainer3d/preemption.py): the same task again (it resumes from the newest
        checkpoint, train.resume=auto), or None past launcher.max_requeues, which ends the job."""
        cap = self.cfg.launcher.max_requeues
        if self.requeues >= cap:
            print(f"trainer3d: not requeuing: launcher.max_requeues={cap} requeue(s) done already",
                  file=sys.stderr, flush=True)
            return None
        print(f"trainer3d: requeuing (requeue {self.requeues + 1} of at most {cap})", file=sys.stderr, flush=True)
        return submitit.helpers.DelayedSubmission(TrainTask(self.cfg, self.requeues + 1))


# --------------------------------------------------------------------------- submitting process

def make_executor(cfg: Config, world_size: int) -> submitit.Executor:
    folder = Path(cfg.launcher.folder)
    executor = submitit.AutoExecutor(folder=folder, cluster="local")
    executor.update_parameters(tasks_per_node=world_size, timeout_min=cfg.launcher.timeout_min,
                               name=cfg.launcher.job_name)
    return executor


def launch(cfg: Config) -> int:
    """Run the job described by a validated config; return the process exit status."""
    if cfg.launcher.name == "inplace" or in_distributed_env():
        TrainTask(cfg)()
        return 0
    if cfg.launcher.name == "slurm":
        from trainer3d.slurm import launch_slurm  # noqa: F401  (see the Slurm launcher)
        return launch_slurm(cfg)
    p = cfg.parallel
    world = p.tp * p.pp * p.dp
    executor = make_executor(cfg, world)
    job = executor.submit(TrainTask(cfg))
    print(f"trainer3d: {world} local rank(s) (tp={p.tp} pp={p.pp} dp={p.dp}), job {job.job_id}, "
          f"logs in {cfg.launcher.folder}", flush=True)
    return follow(job, grace_s=cfg.parallel.timeout_s + 10)


class _Tail:
    """Echo the new complete lines of a growing log file (rank 0's stdout)."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def echo(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.pos += end
        for line in data[:end].decode(errors="replace").splitlines():
            if not line.startswith("submitit "):
                print(line, flush=True)


def _task_outcome(job: submitit.Job, task: int) -> Optional[tuple]:
    """("success", result) or ("error", traceback text) once task's result is written, else None."""
    path = job.task(task).paths.result_pickle
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (EOFError, pickle.UnpicklingError):  # being written
        return None


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def follow(job: submitit.Job, grace_s: float) -> int:
    """Echo rank 0's progress until every task ends; on a failure, cancel the rest and explain."""
    tasks = list(range(job.num_tasks))
    tail = _Tail(job.task(0).paths.stdout)
    failed_at: Optional[float] = None
    cancelled = False
    while not job.done():
        tail.echo()
        outcomes = {t: _task_outcome(job, t) for t in tasks}
        if failed_at is None and any(o and o[0] == "error" for o in outcomes.values()):
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > grace_s:
            job.cancel()  # the survivors should have timed out by now: do not wait for them
            cancelled = True
            _wait_done(job, timeout_s=30)
            break
        time.sleep(POLL_S)
    tail.echo()
    return report(job, tasks, cancelled)


def _wait_done(job: submitit.Job, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not job.done() and time.time() < deadline:
        time.sleep(POLL_S)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def report(job: submitit.Job, tasks: List[int], cancelled: bool = False) -> int:
    """0 if every rank returned; else print what happened to each failed rank, cause first."""
    outcomes = {t: _task_outcome(job, t) for t in tasks}
    errors = {t: o[1] for t, o in outcomes.items() if o and o[0] == "error"}
    missing = [t for t, o in outcomes.items() if o is None]
    if not errors and not missing:
        return 0
    print(f"\ntrainer3d: job {job.job_id} failed", file=sys.stderr)
    for t in missing:
        fate = "still running after the others failed; cancelled" if cancelled else \
            "exited without a result (killed, out of memory, or crashed outside Python)"
        print(f"  rank {t}: {fate}", file=sys.stderr)
    # The earliest error is the likeliest cause; later ones are peers seeing its connection close.
    by_time = sorted(errors, key=lambda t: job.task(t).paths.result_pickle.stat().st_mtime)
    for t in by_time:
        print(f"  rank {t}: {_last_line(errors[t])}", file=sys.stderr)
    if missing and not cancelled:
        t = missing[0]
        print(f"--- rank {t} log tail ({job.task(t).paths.stderr}) ---\n{_log_tail(job.task(t).paths.stderr)}",
              file=sys.stderr)
    elif by_time:
        print(f"--- rank {by_time[0]} traceback ---\n{errors[by_time[0]]}", file=sys.stderr)
    return 1
