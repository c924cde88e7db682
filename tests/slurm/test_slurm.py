"""The Slurm launcher against a real cluster on this machine (slurm/cluster.sh): jobs, sweeps,
errors, and the users' own sbatch template. Preemption requeue with resume, parity with one
process and a lost node: test_slurm_two_nodes.py."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.conftest import ROOT
from tests.support.run_scripts import run_all
from tests.support.runs import PARITY, TWO_LAYERS, read_metrics

# One worker runs every Slurm test, one at a time (tests/conftest.py: xdist_scope): they share
# the session's cluster (tests/support/slurm_cluster.py).
pytestmark = pytest.mark.slurm

# PARITY's batch and model (tests/support/runs.py), its step count left to each test.
SMALL = (*(o for o in PARITY if not o.startswith("train.max_steps=")), *TWO_LAYERS, "parallel=single")
PP2 = ("parallel.pp=2",)  # two pipeline stages, two tasks (test_slurm_two_nodes.py: one on each node)


def train(env, run_dir: Path, *overrides, timeout=600):
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


class Followed:
    """``train(..., launcher.wait=true)`` in a thread while the test acts on the job; ``proc`` is
    the finished submitting process once the ``with`` block has ended. A block that raises
    cancels the job first, so its follower returns instead of outliving the test."""

    def __init__(self, env, run_dir: Path, *overrides, earlier: Optional[str] = None):
        self.env, self.run, self.proc, self.earlier = env, run_dir, None, earlier
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
            time.sleep(0.1)  # a step is 0.08 s on an idle machine: a signal sent steps late may come after the last

    def job(self) -> str:
        """The Slurm job id the submitting process wrote to ``slurm_job.json`` (a job of its own,
        not the ``earlier`` one a resubmission finds recorded there)."""
        self.until(lambda: self._recorded() not in (None, self.earlier), "the job's submission")
        return self._recorded()

    def _recorded(self) -> Optional[str]:
        record = self.run / "slurm_job.json"
        try:
            return json.loads(record.read_text())["job_id"]
        except (FileNotFoundError, json.JSONDecodeError):  # not yet, or being written
            return None


def rank0_log(run: Path, job: str) -> str:
    """Rank 0's log of every attempt of ``job`` (its stderr, then its stdout: each appended to by a requeued attempt)."""
    return "".join(p.read_text(errors="replace") for p in sorted((run / "submitit").glob(f"{job}_0_log.*")))


# One sweep for two claims: its two points run as two Slurm jobs side by side, each followed
# (launcher.wait=true), and the one whose rank 1 fails after it joins the group
# (tests/support/plugins/fail_rank: a fault no check before launch sees) is shown with that
# rank, while the point without a rank 1 trains to its end (trainer3d/launch/sweep.py).
def test_two_point_sweep_runs_as_two_jobs_and_a_failing_rank_is_shown(slurm_cluster, tmp_path):
    plugin = Path(__file__).resolve().parents[1] / "support" / "plugins" / "fail_rank"
    env = dict(slurm_cluster, TRAINER3D_TEST_FAIL_RANK="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin), slurm_cluster.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "trainer3d.train", "-m", *SMALL, "train.max_steps=4", "parallel.dp=1,2",
           "launcher=slurm", "launcher.wait=true", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    jobs = [json.loads((tmp_path / "sweep" / n / "slurm_job.json").read_text())["job_id"] for n in ("0", "1")]
    assert len(set(jobs)) == 2
    assert proc.returncode == 1, out[-3000:]  # the worst point's status
    assert f"#0 parallel.dp=1: job {jobs[0]} ok" in proc.stdout, proc.stdout[-3000:]
    assert len(read_metrics(tmp_path / "sweep" / "0")) == 4
    assert f"#1 parallel.dp=2: job {jobs[1]} failed" in proc.stdout, proc.stdout[-3000:]
    assert f"job {jobs[1]} failed: rank 1" in proc.stderr and "planted failure on rank 1" in out, out[-3000:]


# Both refusals in one interpreter (tests/support/run_scripts.py: torch imported once), each
# through the entry point as ``python -m trainer3d.train`` runs it.
REFUSALS = {"launcher.partition=nosuchpartition": ("invalid partition", ()),
            "launcher.nodes=8": ("launcher.nodes=8 but the default partition has",
                                 ("launcher.tasks_per_node=1", "parallel.dp=8"))}


def test_sbatch_refusals_are_explained(slurm_cluster, tmp_path):
    entries = [("-m trainer3d.train", [f"hydra.run.dir={tmp_path / str(i)}", *SMALL, "train.max_steps=2",
                                       "launcher=slurm", override, *extra])
               for i, (override, (_, extra)) in enumerate(REFUSALS.items())]
    for (override, (expect, _)), proc in zip(REFUSALS.items(), run_all(entries, cwd=ROOT, env=slurm_cluster)):
        assert proc.returncode == 2, (override, proc.stdout + proc.stderr)
        assert expect in proc.stderr.lower() if expect.islower() else expect in proc.stderr, (override, proc.stderr)
        assert "Traceback" not in proc.stderr, (override, proc.stderr)


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
