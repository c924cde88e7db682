"""A pipeline stage that hangs mid-training ends the job, with the cause shown, in bounded time.
A rank that dies is seen dead at once by its pid (trainer3d/launch/follow.py), whatever group its
peers wait on: tests/integration/test_checkpoint_resume.py's test_kill_mid_save_keeps_the_previous_checkpoint
kills one of the real trainer's ranks and reads the report (the dead rank, the survivor, its log tail).

The real trainer runs on real submitit ranks (as ``python -m trainer3d.train`` starts them),
each with its heartbeat, followed as the local launcher follows them; only one rank's
``Pipeline.forward_backward`` is replaced to fail at a given step.
"""

import itertools
import os
import re
import time

import pytest
import submitit
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
from tests.support.runs import PARITY
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.launch.follow import follow
from trainer3d.rank.heartbeat import Heartbeat, heartbeat_dir
from trainer3d.rank.body import run_rank
from trainer3d.parallel.pipeline.schedule import Pipeline
from trainer3d.config.validate import validate

# The step's collective timeout, which the stuck stage's peers wait out once (start-up has its own,
# parallel.init_timeout_s): a healthy step of this run takes well under a second on an idle
# machine, so 12 s leaves a loaded one ten times that and more.
TIMEOUT_S = 12
FAULT_AT = 1
"""The faulty rank's pipeline call that hangs: the second step's, once a whole step has run
on every stage (the failure comes mid-training, not at start-up)."""


def _config(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name="config", overrides=[
            *PARITY, "parallel=single", f"parallel.timeout_s={TIMEOUT_S}", "train.max_steps=50",
            # 4 micro-batches a step at pp2, 2 per rank at pp2 x dp2 (the pipe filled once); no MFU peak measured
            "train.global_batch_size=8", "train.peak_tflops=1",
            f"run_dir={tmp_path}", f"launcher.folder={tmp_path / 'submitit'}", *overrides])
    return validate(OmegaConf.to_object(dcfg))


def train_with_a_faulty_rank(cfg, faulty_rank, at_step):
    submitit.helpers.TorchDistributedEnvironment().export(overwrite=True)
    if int(os.environ["RANK"]) == faulty_rank:
        original, calls = Pipeline.forward_backward, itertools.count()

        def faulty(self, inputs, targets, *rest):
            if next(calls) == at_step:
                time.sleep(3600)  # alive but stuck
            return original(self, inputs, targets, *rest)

        Pipeline.forward_backward = faulty
    heartbeat = Heartbeat(heartbeat_dir(cfg.run_dir), int(os.environ["RANK"])).start()
    try:
        return run_rank(cfg, heartbeat)
    finally:
        heartbeat.stop()


def _run(tmp_path, capfd, overrides, faulty_rank):
    cfg = _config(tmp_path, overrides)
    world = cfg.parallel.pp * cfg.parallel.dp
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="local")
    executor.update_parameters(tasks_per_node=world, timeout_min=10)
    job = executor.submit(train_with_a_faulty_rank, cfg, faulty_rank, FAULT_AT)
    try:
        status = follow(job, TIMEOUT_S, heartbeat_dir(cfg.run_dir), pids_here=True)
    finally:
        if not job.done():  # a failing test must not leave its ranks behind
            job.cancel()
    return status, capfd.readouterr().err, job


# Bounded by the test's timeout, not by a wall-time assertion: a peer left waiting on a group
# without parallel.timeout_s would hang for gloo's default 30 minutes, far past it.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stuck_stage_times_out_instead_of_hanging(tmp_path, capfd):
    """pp=2 x dp=2: every survivor blocks on a pp or dp sub-group, never on the default group,
    so this ends only if the sub-groups carry parallel.timeout_s (torch would give them 30 min)."""
    status, err, job = _run(tmp_path, capfd, ["parallel.pp=2", "parallel.dp=2"], faulty_rank=2)
    assert status == 1 and job.done()
    assert re.search(r"rank 2: still running at step \d+ after the others failed; cancelled", err), err
    assert "Timed out" in err or "timed out" in err, err
