"""Two compute nodes (slurm/cluster.sh: each slurmd in network + UTS namespaces of its own):
a 2 nodes x 2 tasks job (tp2 within each node, dp2 across them) through the real entry point
equals the local run; a pp2 job, one stage on each node, requeues on preemption and resumes
across both nodes, a lost node ends it, named, and a resubmission resumes it from the last
checkpoint to the local run's losses."""

import json
import subprocess
import time
from pathlib import Path

import pytest

from trainer3d.rank.preemption import REQUEUE_ASKED
from tests.support.slurm_cluster import SCRIPT
from tests.slurm.test_slurm import PP2, SMALL, Followed, losses, rank0_log, train

# On the worker that runs test_slurm.py, after or before it (tests/conftest.py: xdist_scope).
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TWO_NODES = ("launcher=slurm", "launcher.nodes=2", "parallel.timeout_s=30")
TP2_DP2 = ("parallel.tp=2", "parallel.pp=1", "parallel.dp=2")  # two tasks a node: tp within it, dp across
STEPS = "train.max_steps=20"
# What the two-node jobs must reproduce, step for step: the same layouts on local ranks
# (tests/slurm/conftest.py local_losses; pp2's is test_slurm.py's too, trained once).
TP2_DP2_LOCAL, PP2_LOCAL = (*SMALL, *TP2_DP2, STEPS), (*SMALL, *PP2, STEPS)


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


def _hosts(run: Path, ranks: int):
    return sorted(json.loads((run / "heartbeat" / f"rank{r}").read_bytes())["host"] for r in range(ranks))


# pp2 across the nodes is the job of the test after this one (preemption, then a lost node),
# held to its hosts and its local run's losses the same way.
def test_two_nodes_match_the_local_run(two_nodes, tmp_path, local_losses):
    run = tmp_path / "run"
    proc = train(two_nodes, run, *SMALL, *TP2_DP2, STEPS, *TWO_NODES, "launcher.tasks_per_node=2", "launcher.wait=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _hosts(run, 4) == ["t3d-n1", "t3d-n1", "t3d-n2", "t3d-n2"], "two ranks on each node"
    assert losses(run) == local_losses(TP2_DP2_LOCAL)


def _checkpoints(run: Path):
    return sorted(p.name for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".partial"))


# One job for two claims about the same run (same layout, overrides and losses): preemption
# requeues it and it resumes across both nodes, the follower following it through the requeue;
# then a lost node ends the resumed job, named, and a resubmission resumes it.
@pytest.mark.timeout(900)  # two attempts and a resubmission: up to ~400 s on a loaded machine, near pytest's 600 s
def test_preemption_resumes_across_both_nodes_and_a_lost_node_ends_the_job_named(two_nodes, tmp_path, local_losses):
    run = tmp_path / "run"
    overrides = (*SMALL, *PP2, STEPS, *TWO_NODES, "launcher.tasks_per_node=1", "checkpoint.every=5")
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
    assert "node t3d-n2 stopped responding: ranks 1 " in headline[0], proc.stderr[-3000:]
    assert took < 2 * 30, "one parallel.timeout_s at most (the slack is for a loaded machine)"
    newest = _checkpoints(run)[-1]  # the newest published when the node died: the resumed attempt's
    assert newest > f"step_{stopped:08d}" and newest >= "step_00000010", (stopped, newest)
    again = train(two_nodes, run, *overrides, "launcher.wait=true")  # train.resume=auto: the newest checkpoint
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout and newest in again.stdout, (newest, again.stdout[-3000:])
    assert _hosts(run, 2) == ["t3d-n1", "t3d-n2"], "one stage on each node"
    assert losses(run) == local_losses(PP2_LOCAL)
