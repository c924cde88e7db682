"""``launcher=slurm`` where Slurm cannot be reached (a PATH without its commands): the entry point
says so in one line, with no traceback, and launches nothing. It needs no cluster, so it runs
beside the other tests, not inside the Slurm tier's one work unit (tests/conftest.py:
xdist_scope), whose length bounds the suite's."""

import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.slurm.test_slurm import SMALL


def test_unreachable_cluster_is_explained(tmp_path):
    env = dict(os.environ, PATH="/usr/bin/nonexistent:" + os.path.dirname(sys.executable))
    cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={tmp_path / 'run'}", *SMALL, "train.max_steps=2",
           "launcher=slurm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 1 and "Slurm is not reachable" in proc.stderr and "Traceback" not in proc.stderr
