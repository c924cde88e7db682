import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    """A directory shared by a whole test session (cached reference runs)."""
    return tmp_path_factory.mktemp("session")
from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (session fixture)
