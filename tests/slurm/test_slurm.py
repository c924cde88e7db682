"""The Slurm launcher against a real cluster on this machine (slurm/cluster.sh): jobs, sweeps,
preemption requeue with resume, errors, and the users' own sbatch template."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm.conftest import losses
from tests.support.runs import read_metrics
from trainer3d.rank.preemption import REQUEUE_ASKED

# One worker runs every Slurm test, one at a time (tests/conftest.py: xdist_scope): they share
# the session's cluster (tests/support/slurm_cluster.py).
pytestmark = pytest.mark.slurm

SMALL = ("train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null",
         "optim.warmup_steps=5", "train.log_every=1", "parallel.timeout_s=60", "parallel=single")
PP2 = ("parallel.pp=2",)  # two pipeline stages, two tasks (dp and tp through Slurm: test_slurm_two_nodes.py)
STEPS = 20  # parity needs 20: room for two requeues GAP steps into their attempts
GAP = 5  # steps each attempt trains before its signal: its stop (a step or two after) leaves room for the next
CHECKPOINT_EVERY = 5  # the first signal lands as the step-5 save is written in the background


def train(env, run_dir: Path, *overrides, timeout=600):
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture
def local_run(local_losses):
    """The pp2 run on local ranks (tests/slurm/conftest.py): what the requeued job must reproduce."""
    return local_losses((*SMALL, *PP2, f"train.max_steps={STEPS}"))


class Followed:
    """``train(..., launcher.wait=true)`` in a thread while the test acts on the job; ``proc`` is
    the finished submitting process once the ``with`` block has ended. A block that raises
    cancels the job first, so its follower returns instead of outliving the test."""

    def __init__(self, env, run_dir: Path, *overrides):
        self.env, self.run, self.proc = env, run_dir, None
        self._thread = threading.Thread(target=self._train, args=overrides)

    def _train(self, *overrides):
        self.proc = train(self.env, self.run, *overrides, "launcher.wait=true")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, kind, *_):
        if kind is not None and (self.run / "slurm_job.json").exists():
            subprocess.run(["scancel", self.job()], env=self.env, capture_output=True)
        self._thread.join(timeout=600)

    def until(self, ready, what: str, timeout: float = 300) -> None:
        """Poll ``ready()``; fail once ``timeout`` passed or the followed job ended without it."""
        deadline = time.monotonic() + timeout
        while not ready():
            ended = self.proc is not None
            assert not ended and time.monotonic() < deadline, (
                f"{what}: not seen ({'the job ended first' if ended else f'not within {timeout:.0f} s'})\n"
                + (self.proc.stdout[-2000:] + self.proc.stderr[-2000:] if ended else ""))
            time.sleep(0.5)

    def job(self) -> str:
        """The Slurm job id the submitting process wrote to ``slurm_job.json``."""
        self.until(lambda: (self.run / "slurm_job.json").exists(), "the job's submission")
        return json.loads((self.run / "slurm_job.json").read_text())["job_id"]

    def rows(self, n: int) -> None:
        """Until ``metrics.jsonl`` holds ``n`` rows (a resumed attempt first cuts it back to its step)."""
        self.until(lambda: _complete_rows(self.run / "metrics.jsonl") >= n, f"step {n}")


def _complete_rows(path: Path) -> int:
    """Rows of a metrics.jsonl rank 0 may be writing (a line without its end is not one yet)."""
    text = path.read_text() if path.exists() else ""
    return sum(1 for line in text.splitlines() if line.rstrip().endswith("}"))


def rank0_log(run: Path, job: str) -> str:
    """Rank 0's log of every attempt of ``job`` (its stderr, then its stdout: each appended to by a requeued attempt)."""
    return "".join(p.read_text(errors="replace") for p in sorted((run / "submitit").glob(f"{job}_0_log.*")))


# One job for three claims about the same run (same overrides, same losses to reproduce): a job
# submitted and followed through Slurm (launcher.wait=true) matches the local run; USR2 twice,
# each GAP steps into an attempt with background saves every CHECKPOINT_EVERY steps, requeues it
# twice and it resumes exactly, no step lost or repeated; the follower follows it through both
# requeues. (tools/bench/preemption_chaos.py runs the same drill more times and times it.)
@pytest.mark.slow
def test_job_through_slurm_requeued_twice_on_usr2_matches_the_local_run(slurm_cluster, tmp_path, local_run):
    run = tmp_path / "run"
    stops = [0]
    with Followed(slurm_cluster, run, *SMALL, *PP2, f"train.max_steps={STEPS}", f"checkpoint.every={CHECKPOINT_EVERY}",
                  "launcher=slurm") as followed:
        job = followed.job()
        for i in range(2):
            followed.rows(stops[-1] + GAP)
            subprocess.run(["scancel", "--signal=USR2", job], check=True, env=slurm_cluster)
            followed.until(lambda i=i: rank0_log(run, job).count("resumed from") > i, f"the resume after signal {i + 1}")
            stops.append(int(rank0_log(run, job).split(REQUEUE_ASKED)[i].rsplit("stopped after step ", 1)[1].split()[0]))
    assert stops[1] >= GAP and stops[2] >= stops[1] + GAP, stops  # each stop after GAP steps of its own attempt
    deadline = time.monotonic() + 600
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=slurm_cluster).stdout.strip():
        assert time.monotonic() < deadline
        time.sleep(1)
    proc = followed.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "submitted Slurm job" in proc.stdout and f"step {STEPS}/{STEPS}" in proc.stdout
    assert json.loads((run / "slurm_job.json").read_text())["num_tasks"] == 2
    log = rank0_log(run, job)
    assert log.count(REQUEUE_ASKED) == 2 and log.count("resumed from") == 2, log[-3000:]
    assert losses(run) == local_run  # same layout, same numbers, every step once


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


def finished(env, job: str, timeout: float = 600) -> str:
    """Poll ``scontrol show job`` until the job ends; its ExitCode. Not ``sbatch --wait``: that
    sleeps 2, 8, then 32 s between its looks (src/sbatch/sbatch.c, _job_wait), so a 20 s job is
    seen done at 42 s. The record stays in slurmctld for MinJobAge (slurm/cluster.sh)."""
    deadline = time.monotonic() + timeout
    while True:
        show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env).stdout
        fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields["ExitCode"]
        assert time.monotonic() < deadline, f"job {job} not ended within {timeout:.0f} s: {show}"
        time.sleep(0.5)


def test_own_sbatch_template_trains_with_srun(slurm_cluster, tmp_path):
    env = dict(slurm_cluster, TRAINER3D_PYTHON=sys.executable)
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", f"--chdir={ROOT}",
                           str(ROOT / "slurm" / "train.sbatch"), *SMALL, "parallel.dp=2", "train.max_steps=4",
                           f"hydra.run.dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    code = finished(slurm_cluster, job)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert code == "0:0", f"exit code {code}\n" + out[-3000:]
    assert len(read_metrics(tmp_path / "run")) == 4 and "step 4/4" in out
