"""``launcher=slurm`` where Slurm cannot be reached (a PATH without its commands): the entry point
says so in one line, with no traceback, and launches nothing. Its ``run`` in this process, on the
config Hydra composes for that command line (as tests/integration/test_runlock.py's checkpoint.dir
test): an interpreter of its own would import Hydra, torch and the engine to print one line. It
needs no cluster, so it runs beside the other tests, not inside the Slurm tier's one work unit
(tests/conftest.py: xdist_scope), whose length bounds the suite's."""

import os
import sys

from tests.slurm.test_slurm import SMALL
from tests.support.runs import configure
from trainer3d import train
from trainer3d.rank.resume import COMMAND_VAR


def test_unreachable_cluster_is_explained(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin/nonexistent:" + os.path.dirname(sys.executable))
    monkeypatch.setenv(COMMAND_VAR, "")  # run() records the resume command here; restored after
    cfg = configure(tmp_path / "run", [*SMALL, "train.max_steps=2", "launcher=slurm"])
    assert train.run(cfg) == 1
    err = capsys.readouterr().err
    assert "Slurm is not reachable" in err, err
    assert not (tmp_path / "run" / "submitit").exists() or not any((tmp_path / "run" / "submitit").iterdir())
