"""The Slurm launcher against a real cluster on this machine (slurm/cluster.sh): jobs, sweeps,
preemption requeue with resume, errors, and the users' own sbatch template."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support.runs import read_metrics, train_in_ranks
from trainer3d.rank.preemption import REQUEUE_ASKED

# One worker runs every Slurm test, one at a time (tests/conftest.py: xdist_scope): they share
# the session's cluster (tests/support/slurm_cluster.py).
pytestmark = pytest.mark.slurm

SMALL = ("train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null",
         "optim.warmup_steps=5", "train.log_every=1", "parallel.timeout_s=60", "parallel=single")
PP2 = ("parallel.pp=2",)  # two pipeline stages, two tasks (dp and tp through Slurm: test_slurm_two_nodes.py)
STEPS = 30  # room for two requeues ten steps apart; parity needs 20


def train(env, run_dir: Path, *overrides, timeout=600):
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def losses(run_dir: Path):
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows))), "one row per step: none lost, none repeated"
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The pp2 run on local ranks (in-process: tests/support/runs.py train_in_ranks): what every
    Slurm run must reproduce."""
    run = tmp_path_factory.mktemp("local") / "run"
    train_in_ranks(run, [*SMALL, *PP2, f"train.max_steps={STEPS}"])
    return losses(run)


@contextlib.contextmanager
def following(env, run_dir: Path, *overrides):
    """``train(..., launcher.wait=true)`` in a thread while the test acts on the job; yields a dict
    that holds the finished process as ``proc`` after the block. A block that raises cancels the
    job first, so its follower returns instead of outliving the test."""
    follow = {}
    waiter = threading.Thread(target=lambda: follow.update(proc=train(env, run_dir, *overrides, "launcher.wait=true")))
    waiter.start()
    try:
        yield follow
    except BaseException:
        record = run_dir / "slurm_job.json"
        if record.exists():
            subprocess.run(["scancel", json.loads(record.read_text())["job_id"]], env=env, capture_output=True)
        raise
    finally:
        waiter.join(timeout=600)


def job_id(run_dir: Path, timeout: float = 300) -> str:
    """The Slurm job id the submitting process wrote to ``slurm_job.json``, once it has."""
    record, deadline = run_dir / "slurm_job.json", time.monotonic() + timeout
    while not record.exists():
        assert time.monotonic() < deadline, "no job submitted"
        time.sleep(0.5)
    return json.loads(record.read_text())["job_id"]


def wait_rows(run: Path, n: int, timeout: float = 300) -> None:
    """Until ``metrics.jsonl`` holds ``n`` rows (a resumed attempt first cuts it back to its step)."""
    deadline = time.monotonic() + timeout
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < n:
        assert time.monotonic() < deadline, f"the job did not reach step {n}"
        time.sleep(0.5)


def rank0_log(run: Path, job: str) -> str:
    """Rank 0's log of every attempt of ``job`` (its stderr, then its stdout: each appended to by a requeued attempt)."""
    return "".join(p.read_text(errors="replace") for p in sorted((run / "submitit").glob(f"{job}_0_log.*")))


# One job for two claims (each a run of its own before: the same overrides, the same losses to
# reproduce): a job submitted and followed through Slurm (launcher.wait=true) matches the local
# run, and USR2 twice requeues it twice and it resumes exactly, the follower following it through.
@pytest.mark.slow
def test_job_through_slurm_requeued_twice_on_usr2_matches_the_local_run(slurm_cluster, tmp_path, local_run):
    run = tmp_path / "run"
    with following(slurm_cluster, run, *SMALL, *PP2, f"train.max_steps={STEPS}", "launcher=slurm") as follow:
        job = job_id(run)
        for i, at in enumerate((10, 20)):
            wait_rows(run, at)
            subprocess.run(["scancel", "--signal=USR2", job], check=True, env=slurm_cluster)
            deadline = time.monotonic() + 300  # wait for the requeued attempt to resume
            while rank0_log(run, job).count("resumed from") < i + 1:
                assert time.monotonic() < deadline, f"no resume after signal {i + 1}:\n{rank0_log(run, job)[-3000:]}"
                time.sleep(1)
    deadline = time.monotonic() + 600
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=slurm_cluster).stdout.strip():
        assert time.monotonic() < deadline
        time.sleep(2)
    proc = follow["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "submitted Slurm job" in proc.stdout and f"step {STEPS}/{STEPS}" in proc.stdout
    assert json.loads((run / "slurm_job.json").read_text())["num_tasks"] == 2
    log = rank0_log(run, job)
    assert log.count(REQUEUE_ASKED) == 2 and log.count("resumed from") == 2, log[-3000:]
    assert losses(run) == local_run  # same layout, same numbers


def test_two_point_sweep_runs_as_two_jobs(slurm_cluster, tmp_path):
    cmd = [sys.executable, "-m", "trainer3d.train", "-m", *SMALL, "train.max_steps=4", "parallel.dp=1,2",
           "launcher=slurm", "launcher.wait=true", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=slurm_cluster, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = {json.loads((tmp_path / "sweep" / n / "slurm_job.json").read_text())["job_id"] for n in ("0", "1")}
    assert len(jobs) == 2
    for n in ("0", "1"):
        assert len(read_metrics(tmp_path / "sweep" / n)) == 4


@pytest.mark.parametrize("override,expect", [
    ("launcher.partition=nosuchpartition", "invalid partition"),
    ("launcher.nodes=8", "launcher.nodes=8 but the default partition has"),
])
def test_sbatch_refusals_are_explained(slurm_cluster, tmp_path, override, expect):
    extra = ("launcher.tasks_per_node=1", "parallel.dp=8") if "nodes" in override else ()
    proc = train(slurm_cluster, tmp_path / "run", *SMALL, "train.max_steps=2", "launcher=slurm", override, *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expect in proc.stderr.lower() if expect.islower() else expect in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_job_failing_on_the_cluster_shows_the_failing_rank(slurm_cluster, tmp_path):
    # Rank 1 fails after it joins the group (tests/support/plugins/fail_rank): nothing checked before launch sees it.
    plugin = Path(__file__).resolve().parents[1] / "support" / "plugins" / "fail_rank"
    env = dict(slurm_cluster, TRAINER3D_TEST_FAIL_RANK="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin), slurm_cluster.get("PYTHONPATH")])))
    proc = train(env, tmp_path / "run", *SMALL, "parallel.dp=2", "train.max_steps=2", "launcher=slurm",
                 "launcher.wait=true")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "planted failure on rank 1" in out and "rank 1" in out, out[-3000:]


def test_own_sbatch_template_trains_with_srun(slurm_cluster, tmp_path):
    env = dict(slurm_cluster, TRAINER3D_PYTHON=sys.executable)
    proc = subprocess.run(["sbatch", "--parsable", "--wait", f"--output={tmp_path}/slurm-%j.out", f"--chdir={ROOT}",
                           str(ROOT / "slurm" / "train.sbatch"), *SMALL, "parallel.dp=2", "train.max_steps=4",
                           f"hydra.run.dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=600, env=env)
    job = proc.stdout.strip().split(";")[0]
    out = (tmp_path / f"slurm-{job}.out").read_text() if job else ""
    assert proc.returncode == 0, proc.stderr + out[-3000:]
    assert len(read_metrics(tmp_path / "run")) == 4 and "step 4/4" in out
