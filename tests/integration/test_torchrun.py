"""A complete run under torchrun (``launcher=inplace``: the ranks are torchrun's workers, as an
``srun`` step's tasks are) ends with exit status 0 on every worker: torchrun reports any worker
that exits otherwise, a signal included, and fails the job. The run's metrics and final
checkpoint are there. Every step saves in the background, so the last save's thread is still
freeing its copy as the run ends: before ``Background._finish`` joined it, one run in three
aborted at exit (tests/unit/test_saver_thread.py holds the mechanism deterministically)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from trainer3d.checkpoint import store

STEPS = 2
RUN = ("launcher=inplace", "parallel=dp2", f"train.max_steps={STEPS}", "train.log_every=1", "train.seq_len=64",
       "train.micro_batch_size=2", "train.global_batch_size=8", "train.grad_accum_steps=null",
       "checkpoint.every=1", "checkpoint.async_save=true")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_complete_run_under_torchrun_exits_0(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "trainer3d.train",
           *RUN, f"hydra.run.dir={tmp_path / 'run'}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for sign in ("Traceback", "terminate called", "Aborted", "Fatal Python error", "ChildFailedError"):
        assert sign not in out, out[-6000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == STEPS
    assert store.step_dir(tmp_path / "run" / "checkpoints", STEPS).is_dir()
