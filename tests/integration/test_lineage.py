"""A run's identity, through the entry point: a sweep's points are wandb runs of one group, and
a stopped sweep point's resume command resumes that point (run here), a rollback to an older checkpoint sets the abandoned newer ones aside so
``auto`` never takes them, ranks started in place agree on one run dir or are refused, and a
resume with another global batch continues after the samples the checkpoint consumed."""

import os
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT
from tests.integration.test_runlock import SMALL
from tests.support.runs import configure, train_in_ranks
from tests.support.wandb_records import read_run, run_files
from trainer3d.checkpoint import store
from trainer3d.checkpoint.choose import choose
from trainer3d.rank.resume import resume_command

SMALL = tuple(o for o in SMALL if not o.startswith("train.max_steps="))
TINY = ("model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "parallel.timeout_s=60")


@pytest.mark.slow
def test_a_sweeps_points_are_wandb_runs_of_one_group_and_a_points_resume_command_resumes_it(tmp_path):
    """One sweep of two points through the entry point, logging to wandb offline: each point is a
    wandb run of its own, in one group named after the sweep's directory; point 0's resume
    command (the one its stop line prints) resumes that point, in that point's directory. The
    points differ by seed on one rank each (one wandb run however many ranks a run has:
    test_metrics.py's 4-rank run)."""
    sweep = tmp_path / "sweep-42"
    argv = ["/x/trainer3d/train.py", "-m", f"hydra.sweep.dir={sweep}", *SMALL, *TINY, "train.max_steps=2",
            "train.seed=1,2", "logger=wandb", "logger.mode=offline"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "-m", "trainer3d.train", *argv[1:]], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [read_run(f) for point in ("0", "1") for f in run_files(sweep / point)]
    assert len({r["run"].run_id for r in runs}) == 2
    assert {r["run"].run_group for r in runs} == {"sweep-42"}
    point = sweep / "0"
    overrides = yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text())  # Hydra's overrides.task
    cfg = configure(point, [o for o in overrides if not o.startswith("hydra.")])
    command = shlex.split(resume_command(cfg, argv, overrides))
    resumed = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=900,
                             cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {store.step_dir(point / 'checkpoints', 2)} at step 2" in resumed.stdout, resumed.stdout
    assert not (tmp_path / "multirun").exists() and sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]


@pytest.mark.slow
def test_a_rollback_with_another_global_batch_sets_the_abandoned_checkpoints_aside_and_continues_the_data(tmp_path):
    """One run rolled back from its step-4 checkpoint to its step-2 one with half the global batch:
    the newer checkpoint is set aside, where ``auto`` never takes it, and the data continues after
    the samples the step-2 checkpoint consumed (the rollback and the changed batch are independent
    mechanisms, trainer3d/checkpoint/lineage.py set_aside and trainer3d/data/loader.py: one resume
    shows both)."""
    run = tmp_path / "run"
    base = [*SMALL, *TINY, "checkpoint.keep=10", "checkpoint.async_save=false"]
    train_in_ranks(run, [*base, "train.max_steps=4", "checkpoint.every=2", "train.global_batch_size=8"])
    root = run / "checkpoints"
    assert [s for s, _ in store.published(root)] == [2, 4]
    later = [*base, "train.max_steps=3", "train.global_batch_size=4"]
    out = train_in_ranks(run, [*later, f"train.resume={store.step_dir(root, 2)}"])
    assert "abandons 1 newer checkpoint(s)" in out, out
    assert "train.global_batch_size 8 -> 4: the data continues after the 16 samples" in out, out
    assert [s for s, _ in store.published(root)] == [2, 3]
    assert store.read_marker(store.step_dir(root, 3))["samples"] == 2 * 8 + 1 * 4
    aside = list((root / "abandoned").glob("*/step_00000004"))
    assert len(aside) == 1 and store.is_complete(aside[0]) == (True, "")
    assert choose(configure(run, later), root).step == 3


def test_ranks_started_in_place_without_a_run_dir_are_refused(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29917",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "trainer3d.train", "launcher=inplace", *SMALL, "parallel=dp2",
                           "train.max_steps=1", "parallel.init_timeout_s=20"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "each of the 2 ranks started by torchrun or srun names its own run dir" in proc.stderr
    assert "hydra.run.dir=" in proc.stderr
