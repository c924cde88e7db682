"""``launcher=slurm``: submit the run as one Slurm job through submitit, and say clearly why not.

The job is ``nodes x tasks_per_node`` tasks, one rank each; submitit writes the sbatch
script (``srun python -m submitit.core._submit``), and every task runs the same
``TrainTask`` (``trainer3d.rank.task``) as the local launcher (``trainer3d.launch.local``).
This process prints the job id, the log paths and the commands to follow the job, writes
``<run_dir>/slurm_job.json``, and
with ``launcher.wait=true`` follows it with ``trainer3d.launch.follow`` (rank 0's progress lines;
on a failure the cause in one line, and the job cancelled) and returns its status; told to
stop meanwhile (SIGTERM, SIGINT, SIGHUP) it cancels the job and waits until it is gone.

What can go wrong before the job runs, each a one-paragraph message and a status:
no Slurm client on PATH or slurmctld not answering (1), sbatch refusing the job — its own
message, e.g. a bad partition or more nodes than the partition has (2), a run dir another
run or a queued job still owns (2; rank 0 holds its lock once the job runs).
"""

import contextlib
import io
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

import submitit
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from trainer3d.config.schema import Config
from trainer3d.launch.follow import follow
from trainer3d.rank.heartbeat import heartbeat_dir
from trainer3d.launch.interrupt import Interrupted, JobSignals
from trainer3d.launch.local import submit_with_token
from trainer3d.rank.job_token import new_token
from trainer3d.rank.task import TrainTask
from trainer3d.rank.resume import stop_line
from trainer3d.rank.runlock import RunDirBusy, RunDirLock
from trainer3d.config.validate import world_size_of

# Hints for sbatch's refusals (its message is shown in full; the hint names the knob).
_SBATCH_HINTS = (
    ("invalid partition", "launcher.partition: `sinfo -s` lists the partitions you may use"),
    ("node count specification invalid", "launcher.nodes is more than the partition has (`sinfo -s`)"),
    ("requested node configuration is not available",
     "launcher.nodes / tasks_per_node / cpus_per_task / gpus_per_node / mem_gb / constraint ask for more "
     "than any node offers (`sinfo -N -o '%N %c %m %G %f'`)"),
    ("more processors requested than permitted", "launcher.tasks_per_node x cpus_per_task is more than a node has"),
    ("invalid account", "launcher.account: `sacctmgr show assoc user=$USER` lists yours"),
    ("invalid qos", "launcher.qos: `sacctmgr show assoc user=$USER format=qos` lists yours"),
    ("time limit", "launcher.timeout_min is above the partition's limit (`sinfo -s`)"),
    ("invalid feature", "launcher.constraint names a feature no node has (`sinfo -o '%N %f'`)"),
)


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be reached from here: no client commands, or slurmctld does not answer."""


def sbatch_extra_parameters(lines: List[str]) -> Dict[str, Union[str, bool]]:
    """``launcher.sbatch_extra`` ("--exclusive", "#SBATCH --reservation=foo") as submitit's
    ``slurm_additional_parameters`` ({"exclusive": True, "reservation": "foo"})."""
    params: Dict[str, Union[str, bool]] = {}
    for line in lines:
        option = line.strip()
        if option.startswith("#SBATCH"):
            option = option[len("#SBATCH"):].strip()
        if not option.startswith("--") or " " in option.split("=", 1)[0]:
            raise ValueError(f"launcher.sbatch_extra entry {line!r}: give sbatch's long form, "
                             "e.g. '--reservation=foo' or '--exclusive'")
        key, _, value = option[2:].partition("=")
        params[key.replace("-", "_")] = value if value else True
    return params


def slurm_parameters(cfg: Config, world_size: int) -> dict:
    """``AutoExecutor.update_parameters`` arguments for a validated config (pure; tested directly)."""
    launcher = cfg.launcher
    params = {
        "name": launcher.job_name,
        "nodes": launcher.nodes,
        "tasks_per_node": launcher.tasks_per_node or world_size // launcher.nodes,
        "timeout_min": launcher.timeout_min,
        "slurm_signal_delay_s": launcher.signal_delay_s,
    }
    optional = {"gpus_per_node": launcher.gpus_per_node or None, "cpus_per_task": launcher.cpus_per_task,
                "mem_gb": launcher.mem_gb, "slurm_partition": launcher.partition,
                "slurm_account": launcher.account, "slurm_qos": launcher.qos,
                "slurm_constraint": launcher.constraint, "slurm_setup": list(launcher.setup) or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    if launcher.cpus_per_task:
        # srun does not take --cpus-per-task from the job in Slurm 22.05 to 23.02 (their release
        # notes; SchedMD restored it in 23.11): without it each task runs on one CPU.
        params["slurm_srun_args"] = [f"--cpus-per-task={launcher.cpus_per_task}"]
    extra = sbatch_extra_parameters(list(launcher.sbatch_extra))
    if extra:
        params["slurm_additional_parameters"] = extra
    return params


def check_reachable() -> None:
    """Raise SlurmUnavailable unless sbatch is on PATH and slurmctld answers (`scontrol ping`, ~10 ms)."""
    missing = [cmd for cmd in ("sbatch", "srun", "scontrol") if shutil.which(cmd) is None]
    if missing:
        raise SlurmUnavailable(
            f"launcher=slurm needs Slurm's client commands, and {', '.join(missing)} is not on PATH. "
            "Run this on a Slurm login node, or start the dev cluster on this machine with "
            "`slurm/cluster.sh start` (root, Debian); to train here without Slurm use launcher=local.")
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        answer, ok = (ping.stdout + ping.stderr).strip(), ping.returncode == 0 and "DOWN" not in ping.stdout
    except subprocess.TimeoutExpired:
        answer, ok = "scontrol ping: no answer within 30 s", False
    if not ok:
        raise SlurmUnavailable(
            f"the Slurm controller does not answer (`scontrol ping`: {' '.join(answer.split()[:12])}). "
            "Is slurmctld running, and does $SLURM_CONF point at this cluster's slurm.conf? "
            "For the dev cluster on this machine: `slurm/cluster.sh start` (`slurm/cluster.sh status` shows it).")


def check_nodes(cfg: Config) -> None:
    """Refuse more nodes than the partition has: Slurm would accept such a job and leave it
    pending for ever (reason PartitionNodeLimit) unless the site enforces partition limits."""
    cmd = ["sinfo", "-h", "-o", "%P %D"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except subprocess.TimeoutExpired:
        return  # sbatch will tell
    sizes = {}
    for line in out.splitlines():
        name, _, count = line.strip().partition(" ")
        if count.strip().isdigit():
            sizes[name.rstrip("*")] = sizes.get(name.rstrip("*"), 0) + int(count)
            if name.endswith("*"):
                sizes[None] = sizes[name.rstrip("*")]
    have = sizes.get(cfg.launcher.partition)
    if have is not None and cfg.launcher.nodes > have:
        where = f"partition {cfg.launcher.partition}" if cfg.launcher.partition else "the default partition"
        raise ValueError(f"launcher.nodes={cfg.launcher.nodes} but {where} has {have} node(s) (`sinfo -s`): "
                         "the job would wait for ever; set launcher.nodes (and launcher.tasks_per_node) to fit")


def make_slurm_executor(cfg: Config, world_size: int) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=Path(cfg.launcher.folder), cluster="slurm",
                                     slurm_max_num_timeout=cfg.launcher.max_requeues)
    executor.update_parameters(**slurm_parameters(cfg, world_size))
    return executor


def explain_refusal(message: str) -> str:
    """sbatch's own error lines, and a hint naming the knob when the message is a known one."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines[-3:]
    text = " ".join(errors)
    hints = [hint for key, hint in _SBATCH_HINTS if key in text.lower()]
    return f"sbatch refused the job: {text}" + (f" -> check {hints[0]}" if hints else "")


def submit(cfg: Config, world_size: int, task, how=None) -> submitit.Job:
    """Submit ``task`` (through ``how(executor, task)`` if given); raise SlurmUnavailable,
    RunDirBusy, or ValueError with sbatch's refusal explained."""
    check_reachable()
    check_nodes(cfg)
    check_run_dir_free(cfg)
    executor = make_slurm_executor(cfg, world_size)
    # submitit prints sbatch's stderr itself before raising; we show it once, in our message.
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return how(executor, task) if how else executor.submit(task)
        except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as err:
            raise ValueError(explain_refusal(str(err))) from None


def write_job_record(cfg: Config, job: submitit.Job) -> Path:
    """``<run_dir>/slurm_job.json``: what a sweep follower, a test or a user needs to find the job."""
    path = Path(cfg.run_dir) / "slurm_job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"job_id": job.job_id, "folder": str(Path(cfg.launcher.folder)), "num_tasks": job.num_tasks,
              "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr),
              "metrics": str(Path(cfg.run_dir) / "metrics.jsonl")}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def describe_submission(cfg: Config, job: submitit.Job, world_size: int) -> str:
    p, launcher = cfg.parallel, cfg.launcher
    tasks = launcher.tasks_per_node or world_size // launcher.nodes
    out0 = job.task(0).paths.stdout
    return "\n".join([
        f"trainer3d: submitted Slurm job {job.job_id}: {world_size} rank(s) = {launcher.nodes} node(s) x "
        f"{tasks} task(s) (tp={p.tp} pp={p.pp} dp={p.dp}), partition {launcher.partition or '(default)'}",
        f"  logs:    {out0}  (rank r: {job.job_id}_<r>_log.out / .err)",
        f"  metrics: {Path(cfg.run_dir) / 'metrics.jsonl'}",
        f"  follow:  squeue -j {job.job_id}  |  tail -f {shlex.quote(str(out0))}  |  sacct -j {job.job_id}",
        f"  cancel:  scancel {job.job_id}",
    ])


def check_run_dir_free(cfg: Config) -> None:
    """Raise RunDirBusy if another run owns the run dir: its lock is held (a local run, or a
    running job's rank 0), or the Slurm job recorded there is still queued or running."""
    RunDirLock.for_run(cfg).check_free()
    record = Path(cfg.run_dir) / "slurm_job.json"
    if not record.exists():
        return
    job_id = json.loads(record.read_text())["job_id"]
    state = queue_state(job_id)
    if state:
        raise RunDirBusy(f"run dir {cfg.run_dir} belongs to Slurm job {job_id}, still {state} (`squeue -j {job_id}`); "
                         f"wait for it, `scancel {job_id}`, or give this run its own hydra.run.dir=...")


def queue_state(job_id: str) -> str:
    """The job's state while squeue lists it (PENDING, RUNNING, COMPLETING, ...), else ""."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


ACCOUNTING_LAG_S = 15.0
"""How long ``cancel_and_wait`` asks sacct for a cancelled job's end (slurmdbd records it a few
seconds after squeue drops it; a cluster without accounting never does)."""


def cancel_and_wait(job: submitit.Job, wait_s: float = 120) -> None:
    """scancel, then wait (bounded) until squeue no longer lists the job: its ranks are gone;
    then (at most ACCOUNTING_LAG_S) until sacct has its end too, so that ``job.done()`` says so
    at once. submitit asks sacct at most every half of the job's age (submitit/core/core.py,
    InfoWatcher), and a rank killed without a result (a lost node) leaves done() to sacct."""
    subprocess.run(["scancel", str(job.job_id)], capture_output=True, timeout=60)
    deadline = time.monotonic() + wait_s
    while queue_state(job.job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    deadline = min(deadline, time.monotonic() + ACCOUNTING_LAG_S)
    while not job.watcher.is_done(job.job_id, mode="force") and time.monotonic() < deadline:
        time.sleep(0.5)


def launch_slurm(cfg: Config, task=None) -> int:
    """Submit a validated config as a Slurm job; with launcher.wait, follow it and return its status.
    Told to stop while following (SIGTERM, SIGINT, SIGHUP), it cancels the job first."""
    world = world_size_of(cfg)
    with JobSignals() as signals:
        try:
            job = submit(cfg, world, task if task is not None else TrainTask(cfg),
                         lambda executor, t: submit_with_token(executor, t, new_token()))
        except SlurmUnavailable as err:
            print(f"trainer3d: Slurm is not reachable: {err}", file=sys.stderr)
            return 1
        except (ValueError, RunDirBusy) as err:
            print(f"trainer3d: {err}", file=sys.stderr)
            return 2
        write_job_record(cfg, job)
        print(describe_submission(cfg, job, world), flush=True)
        if not cfg.launcher.wait or defer_follow():
            return 0
        try:
            signals.arm()
            return follow_slurm(job, cfg.parallel.timeout_s, Path(cfg.run_dir))
        except Interrupted as sig:
            print(f"trainer3d: {sig.name}: cancelling Slurm job {job.job_id}", file=sys.stderr, flush=True)
            cancel_and_wait(job)
            print(stop_line(cfg, f"Slurm job {job.job_id} cancelled on {sig.name}"), file=sys.stderr, flush=True)
            raise SystemExit(128 + sig.signum) from None


def follow_slurm(job: submitit.Job, timeout_s: float, run_dir: Optional[Path] = None) -> int:
    """``follow`` plus Slurm's own verdict when the job ended without every rank's result."""
    beats = heartbeat_dir(str(run_dir)) if run_dir is not None else None
    status = follow(job, timeout_s, beats, end=lambda: cancel_and_wait(job), running=lambda: job.state == "RUNNING",
                    slurm_job=str(job.job_id))
    if status:
        state = _final_state(job)
        print(f"  Slurm state: {state}; details: sacct -j {job.job_id} -o JobID,State,ExitCode,Elapsed; "
              f"full logs: {job.task(0).paths.stderr.parent}", file=sys.stderr)
    return status


def _final_state(job: submitit.Job) -> str:
    try:
        return job.get_info(mode="force").get("State", "UNKNOWN")
    except Exception:  # noqa: BLE001 - sacct hiccup: the state is a courtesy, the status is what counts
        return "UNKNOWN"


def defer_follow() -> bool:
    """In a Hydra sweep (-m) every point is submitted first and followed at the end
    (trainer3d.launch.sweep), so the points run side by side instead of one after another."""
    try:
        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - not under Hydra (a test calling launch_slurm directly)
        return False


def load_job(record_path: Path) -> submitit.Job:
    """The submitit job a ``slurm_job.json`` describes (for following it from another process)."""
    record = json.loads(Path(record_path).read_text())
    return submitit.SlurmJob(folder=record["folder"], job_id=record["job_id"],
                             tasks=list(range(record["num_tasks"])))
