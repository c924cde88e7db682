"""Two compute nodes (slurm/cluster.sh: each slurmd in network + UTS namespaces of its own):
a 2 nodes x 2 tasks job through the real entry point equals the local run; preemption
requeues and resumes across both nodes; a lost node ends the job, named, and a resubmission
resumes from the last checkpoint."""

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.runs import train_in_ranks
from trainer3d.rank.preemption import REQUEUE_ASKED
from tests.support.slurm_cluster import SCRIPT
from tests.slurm.test_slurm import SMALL, Followed, losses, rank0_log, train

# On the worker that runs test_slurm.py, after or before it (tests/conftest.py: xdist_scope).
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TWO_NODES = ("launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=2", "parallel.timeout_s=30")
LAYOUTS = {"tp2-pp2": ("parallel.tp=2", "parallel.pp=2", "parallel.dp=1"),  # pp across the nodes
           "tp2-dp2": ("parallel.tp=2", "parallel.pp=1", "parallel.dp=2")}  # dp across the nodes
STEPS = "train.max_steps=20"


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """The same layouts on local ranks (in-process: tests/support/runs.py train_in_ranks): what the
    two-node jobs must reproduce, step for step."""
    out = {}
    for name, layout in LAYOUTS.items():
        run = tmp_path_factory.mktemp("local") / name
        train_in_ranks(run, [*SMALL, *layout, STEPS, "parallel.timeout_s=30"])
        out[name] = losses(run)
    return out


@pytest.fixture
def two_nodes(slurm_cluster):
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, env=slurm_cluster)
    names = sorted(set(nodes.stdout.split()))
    if len(names) < 2:
        reason = Path(slurm_cluster["SLURM_CONF"]).parent.parent / "run" / "one-node-reason"
        why = reason.read_text().strip() if reason.exists() else f"the cluster has {names}"
        import os
        if os.environ.get("CI"):
            pytest.fail(f"no two-node cluster under CI: {why}")
        pytest.skip(f"no two-node cluster here: {why}")
    return slurm_cluster


def _hosts(run: Path):
    return sorted(json.loads((run / "heartbeat" / f"rank{r}").read_bytes())["host"] for r in range(4))


# tp2 x pp2 across the nodes is the job of the test after this one (preemption, then a lost node),
# held to the same hosts and the same losses.
def test_two_nodes_match_the_local_run(two_nodes, tmp_path, local_runs):
    run = tmp_path / "run"
    proc = train(two_nodes, run, *SMALL, *LAYOUTS["tp2-dp2"], STEPS, *TWO_NODES, "launcher.wait=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _hosts(run) == ["t3d-n1", "t3d-n1", "t3d-n2", "t3d-n2"], "two ranks on each node"
    assert losses(run) == local_runs["tp2-dp2"]


def _checkpoints(run: Path):
    return sorted(p.name for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".partial"))


# One job for two claims about the same run (same layout, overrides and losses): preemption
# requeues it and it resumes across both nodes, the follower following it through the requeue;
# then a lost node ends the resumed job, named, and a resubmission resumes it.
@pytest.mark.timeout(900)  # two attempts and a resubmission: up to ~400 s on a loaded machine, near pytest's 600 s
def test_preemption_resumes_across_both_nodes_and_a_lost_node_ends_the_job_named(two_nodes, tmp_path, local_runs):
    run = tmp_path / "run"
    overrides = (*SMALL, *LAYOUTS["tp2-pp2"], STEPS, *TWO_NODES, "checkpoint.every=5")
    with Followed(two_nodes, run, *overrides) as followed:
        job = followed.job()
        followed.rows(8)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, env=two_nodes)
        followed.until(lambda: "resumed from" in rank0_log(run, job), "the resume after the signal")
        stopped = int(rank0_log(run, job).split(REQUEUE_ASKED)[0].rsplit("stopped after step ", 1)[1].split()[0])
        # The resumed attempt publishes a checkpoint of its own (checkpoint.every=5) before the node
        # is lost, so the resubmission resumes past steps only the resumed attempt trained.
        followed.until(lambda: any(int(name[len("step_"):]) > stopped for name in _checkpoints(run)),
                       f"a checkpoint after step {stopped} in the resumed attempt")
        lost = time.monotonic()
        subprocess.run(["bash", str(SCRIPT), "kill-node", "t3d-n2"], check=True, env=two_nodes, capture_output=True)
        time.sleep(2)  # the node reboots: its slurmd comes back, its ranks do not
        subprocess.run(["bash", str(SCRIPT), "start-node", "t3d-n2"], check=True, env=two_nodes, capture_output=True)
    took = time.monotonic() - lost
    proc = followed.proc
    print(f"stopped after step {stopped}; lost node to job end: {took:.1f} s with parallel.timeout_s=30")
    assert REQUEUE_ASKED in proc.stdout and "resumed from" in proc.stdout, proc.stdout[-3000:]
    headline = [line for line in proc.stderr.splitlines() if "failed:" in line]
    assert proc.returncode == 1 and len(headline) == 1, proc.stderr[-3000:]
    assert "node t3d-n2 stopped responding: ranks 2, 3" in headline[0], proc.stderr[-3000:]
    assert took < 2 * 30, "one parallel.timeout_s at most (the slack is for a loaded machine)"
    newest = _checkpoints(run)[-1]  # the newest published when the node died: the resumed attempt's
    assert newest > f"step_{stopped:08d}" and newest >= "step_00000010", (stopped, newest)
    again = train(two_nodes, run, *overrides, "launcher.wait=true")  # train.resume=auto: the newest checkpoint
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout and newest in again.stdout, (newest, again.stdout[-3000:])
    assert _hosts(run) == ["t3d-n1", "t3d-n1", "t3d-n2", "t3d-n2"]
    assert losses(run) == local_runs["tp2-pp2"]
