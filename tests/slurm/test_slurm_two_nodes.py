"""Two compute nodes (slurm/cluster.sh: each slurmd in network + UTS namespaces of its own):
a 2 nodes x 2 tasks job (tp2 within each node, dp2 across them) through the real entry point
trains the one-process model; a pp2 job, one stage on each node, loses a node: it ends, the
node named; its resubmission resumes from the last checkpoint, is preempted twice (USR2) while
it saves in the background every four steps, requeued and resumed across both nodes each time, and trains the one-process
model step for step (tests/support/runs.py reference_losses, assert_parity)."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from trainer3d.rank.preemption import REQUEUE_ASKED
from tests.support.runs import PARITY, TWO_LAYERS, assert_parity, reference_losses, train_losses
from tests.support.slurm_cluster import SCRIPT
from tests.slurm.test_slurm import PP2, Followed, rank0_log, train

# On the worker that runs test_slurm.py, after or before it (tests/conftest.py: xdist_scope).
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TWO_NODES = ("launcher=slurm", "launcher.nodes=2", "parallel.timeout_s=30")
TP2_DP2 = ("parallel.tp=2", "parallel.pp=1", "parallel.dp=2")  # two tasks a node: tp within it, dp across
# What the two-node jobs must reproduce: the session's one-process run of the same model
# (tests/support/runs.py reference_losses, shared with tests/multirank/), 20 steps within
# REL_TOL (the preempted job: its own 40-step reference, PREEMPTED below). Each job takes the
# micro-batches a parity run of its layout takes (runs.py parity_micro_batches: the pipe filled
# once for pp2, two a step for dp2).
REFERENCE = (*PARITY, *TWO_LAYERS)
JOB = (*REFERENCE, "parallel=single")
CHECKPOINT_EVERY = 4  # the first job's node is lost once its step-4 save is published
# Steps each attempt of the resubmission is seen to train before its signal. The stop comes some
# steps later (this test's poll, the signal's way through Slurm, the ranks' agreement at a step
# boundary one all-reduce ahead), and both stops must come before the run's last step, so the
# signal goes as soon as an attempt has trained a step.
GAP = 1
# The preempted run's length: the lost job's newest checkpoint (step 4 or 8) and each stop's
# latency (4-8 steps of 0.08 s on an idle machine, where a 20-step run once ended before its
# second signal came) leave it 16 steps or more to spare.
STEPS = 40
PREEMPTED = (*(o for o in REFERENCE if not o.startswith("train.max_steps=")), f"train.max_steps={STEPS}")


@pytest.fixture
def two_nodes(slurm_cluster):
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, env=slurm_cluster)
    names = sorted(set(nodes.stdout.split()))
    if len(names) < 2:
        reason = Path(slurm_cluster["SLURM_CONF"]).parent.parent / "run" / "one-node-reason"
        why = reason.read_text().strip() if reason.exists() else f"the cluster has {names}"
        if os.environ.get("CI"):
            pytest.fail(f"no two-node cluster under CI: {why}")
        pytest.skip(f"no two-node cluster here: {why}")
    return slurm_cluster


def _hosts(run: Path, ranks: int):
    return sorted(json.loads((run / "heartbeat" / f"rank{r}").read_bytes())["host"] for r in range(ranks))


def test_two_nodes_match_the_local_run(two_nodes, tmp_path, session_tmp):
    run = tmp_path / "run"
    proc = train(two_nodes, run, *JOB, *TP2_DP2, "train.micro_batch_size=4", *TWO_NODES, "launcher.tasks_per_node=2",
                 "launcher.wait=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _hosts(run, 4) == ["t3d-n1", "t3d-n1", "t3d-n2", "t3d-n2"], "two ranks on each node"
    assert_parity(train_losses(run), reference_losses(session_tmp, REFERENCE))


def _checkpoints(run: Path):
    return sorted(p.name for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".partial"))


PROGRESS = re.compile(r"\bstep +(\d+)/\d+ \|")  # rank 0's progress line (trainer3d/observe/metrics.py)


def _trained(run: Path, job: str) -> int:
    """The last step rank 0 of ``job`` said it trained, in any of its attempts. Not metrics.jsonl's
    rows: until the resubmission cuts them back to its checkpoint, they hold the lost job's."""
    return max(map(int, PROGRESS.findall(rank0_log(run, job))), default=0)


def _stopped(run: Path, job: str, i: int) -> int:
    """The step attempt ``i`` of ``job`` stopped after on its signal (rank 0's stop line)."""
    return int(rank0_log(run, job).split(REQUEUE_ASKED)[i].rsplit("stopped after step ", 1)[1].split()[0])


# One run dir, two jobs, one model: the first loses node t3d-n2 and ends, named; its
# resubmission (train.resume=auto) resumes from the first's newest checkpoint, is signalled
# (USR2) GAP steps into each of two attempts with background saves every CHECKPOINT_EVERY steps,
# requeued twice and resumed across both nodes, no step lost or repeated, and its follower
# (launcher.wait=true) follows it through both requeues to its end. (The drill of
# tools/bench/preemption_chaos.py, which runs it more times and times it.)
@pytest.mark.timeout(900)  # two jobs, four attempts: up to ~400 s on a loaded machine, near pytest's 600 s
def test_a_lost_node_ends_the_job_named_and_its_resubmission_resumes_through_two_preemptions(
        two_nodes, tmp_path, session_tmp):
    run = tmp_path / "run"
    overrides = (*PREEMPTED, "parallel=single", *PP2, "train.micro_batch_size=8", *TWO_NODES,
                 "launcher.tasks_per_node=1", f"checkpoint.every={CHECKPOINT_EVERY}")
    with Followed(two_nodes, run, *overrides) as followed:
        first = followed.job()
        followed.until(lambda: _checkpoints(run), f"the step-{CHECKPOINT_EVERY} checkpoint")
        lost = time.monotonic()
        subprocess.run(["bash", str(SCRIPT), "kill-node", "t3d-n2"], check=True, env=two_nodes, capture_output=True)
        time.sleep(2)  # the node reboots: its slurmd comes back, its ranks do not
        subprocess.run(["bash", str(SCRIPT), "start-node", "t3d-n2"], check=True, env=two_nodes, capture_output=True)
    took = time.monotonic() - lost
    proc = followed.proc
    print(f"lost node to job end: {took:.1f} s with parallel.timeout_s=30")
    headline = [line for line in proc.stderr.splitlines() if "failed:" in line]
    assert proc.returncode == 1 and len(headline) == 1, proc.stderr[-3000:]
    assert "node t3d-n2 stopped responding: ranks 1 " in headline[0], proc.stderr[-3000:]
    assert took < 2 * 30, "one parallel.timeout_s at most (the slack is for a loaded machine)"
    newest = _checkpoints(run)[-1]  # the newest published when the node died
    assert newest >= f"step_{CHECKPOINT_EVERY:08d}", newest

    stops = [int(newest[len("step_"):])]
    with Followed(two_nodes, run, *overrides, earlier=first) as followed:
        job = followed.job()
        followed.until(lambda: "resumed from" in rank0_log(run, job), "the resubmission's resume")
        for i in range(2):
            followed.until(lambda: _trained(run, job) >= stops[-1] + GAP, f"step {stops[-1] + GAP}")
            subprocess.run(["scancel", "--signal=USR2", job], check=True, env=two_nodes)
            followed.until(lambda i=i: rank0_log(run, job).count("resumed from") > i + 1,
                           f"the resume after signal {i + 1}")
            stops.append(_stopped(run, job, i))
    assert stops[1] >= stops[0] + GAP and stops[2] >= stops[1] + GAP, stops  # each stop GAP steps into its attempt
    deadline = time.monotonic() + 600
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=two_nodes).stdout.strip():
        assert time.monotonic() < deadline
        time.sleep(1)
    proc = followed.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "submitted Slurm job" in proc.stdout and f"step {STEPS}/{STEPS}" in proc.stdout
    assert REQUEUE_ASKED in proc.stdout and "resumed from" in proc.stdout, proc.stdout[-3000:]
    assert json.loads((run / "slurm_job.json").read_text())["num_tasks"] == 2
    log = rank0_log(run, job)
    assert log.count(REQUEUE_ASKED) == 2 and log.count("resumed from") == 3, log[-3000:]
    resumed = log.split("resumed from", 1)[1].splitlines()[0]
    assert newest in resumed, (newest, resumed)  # the resubmission: the lost job's newest checkpoint
    assert _hosts(run, 2) == ["t3d-n1", "t3d-n2"], "one stage on each node"
    assert_parity(train_losses(run), reference_losses(session_tmp, PREEMPTED))  # every step once, the same model
