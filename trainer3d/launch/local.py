"""Start the ranks as local processes through submitit, from the submitting process.

This process has validated the config and checked the data (trainer3d/preflight/); it takes
the run dir's lock (trainer3d/rank/runlock.py), submits ``TrainTask`` (trainer3d/rank/task.py,
which runs each rank's body, trainer3d/rank/body.py) and follows the job (trainer3d/launch/follow.py): it echoes rank 0's
progress lines; if a rank fails or stops beating it ends the job and names the cause; if it is
itself told to stop (SIGTERM, SIGINT, SIGHUP) it ends the job first
(trainer3d/launch/interrupt.py).
"""

import os
import sys
from pathlib import Path
from typing import Callable

import submitit

from trainer3d.config.schema import Config
from trainer3d.config.validate import world_size_of
from trainer3d.launch.follow import follow
from trainer3d.launch.interrupt import Interrupted, JobSignals, end_processes, terminal_signals_blocked
from trainer3d.rank.heartbeat import heartbeat_dir
from trainer3d.rank.job_token import TOKEN_VAR, new_token, processes_with_token
from trainer3d.rank.master_port import local_port
from trainer3d.rank.owner import OWNER_VAR, owner_id
from trainer3d.rank.resume import stop_line
from trainer3d.rank.runlock import RunDirBusy, RunDirLock
from trainer3d.rank.task import TrainTask


def make_executor(cfg: Config, world_size: int) -> submitit.Executor:
    folder = Path(cfg.launcher.folder)
    executor = submitit.AutoExecutor(folder=folder, cluster="local")
    executor.update_parameters(tasks_per_node=world_size, timeout_min=cfg.launcher.timeout_min,
                               name=cfg.launcher.job_name)
    return executor


def launch_local(cfg: Config, record: Callable[[], None] = lambda: None) -> int:
    """Run a validated config as local processes, one per rank; return the exit status.
    This process holds the run dir's lock meanwhile; ``record`` (the config's record in the run
    dir) is written once it does, so a refused start writes nothing there."""
    try:
        lock = RunDirLock.for_run(cfg).acquire()
    except RunDirBusy as err:
        print(f"trainer3d: {err}", file=sys.stderr)
        return 2
    try:
        record()
        return _local_job(cfg, lock)
    finally:
        lock.release()


def submit_with_token(executor: submitit.Executor, task, token: str, owned: bool = False) -> submitit.Job:
    """Submit with ``TRAINER3D_JOB=token`` (what ``end_processes`` finds) in the job's environment;
    ``owned`` (local jobs, whose ranks run on this machine): this process as the job's owner too
    (``TRAINER3D_OWNER``, what the ranks watch; trainer3d/rank/owner.py), and a free store port
    chosen here unless the user set one (``MASTER_PORT``; trainer3d/rank/master_port.py)."""
    values = {TOKEN_VAR: token}
    if owned:
        values[OWNER_VAR] = owner_id()
        values["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(local_port())
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        return executor.submit(task)
    finally:
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _local_job(cfg: Config, lock: RunDirLock) -> int:
    """One process per rank on this machine, followed until it ends."""
    p = cfg.parallel
    world = world_size_of(cfg)
    token = new_token()

    def end() -> None:
        end_processes(token, reap=job.done)

    with JobSignals() as signals:
        lock.record(None, token)
        lock.share()  # the ranks hold the run dir with this process, and after it (trainer3d/rank/runlock.py)
        with terminal_signals_blocked():  # Ctrl-C and hang-ups reach this process only, not the job's
            job = submit_with_token(make_executor(cfg, world), TrainTask(cfg, lock_run_dir=False), token,
                                    owned=True)
        lock.record(job.job_id, token)
        cp = f" cp={p.cp}" if p.cp > 1 else ""
        print(f"trainer3d: {world} local rank(s) (tp={p.tp}{cp} pp={p.pp} dp={p.dp}), job {job.job_id}, "
              f"logs in {cfg.launcher.folder}", flush=True)
        try:
            signals.arm()
            status = follow(job, p.timeout_s, heartbeat_dir(cfg.run_dir), end=end, job_token=token, pids_here=True)
        except Interrupted as sig:
            wait_s = cfg.launcher.signal_delay_s
            _say(f"trainer3d: {sig.name}: ending job {job.job_id}: its {world} rank(s) stop at the next step "
                 f"boundary and save a checkpoint (up to {wait_s} s, launcher.signal_delay_s; signal again to "
                 "kill them now)")
            end_processes(token, kill_wait_s=wait_s, reap=job.done, hurry=lambda: signals.again)
            _say(stop_line(cfg, f"stopped on {sig.name}"))
            raise SystemExit(128 + sig.signum) from None
        if processes_with_token(token):  # e.g. a child a rank left behind
            end()
    return status


def _say(line: str) -> None:
    """One line on stderr; a terminal that hung up (SIGHUP) cannot take it, and from then on
    this process's output goes nowhere rather than failing the job's ending (EIO)."""
    try:
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
