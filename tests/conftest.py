import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    """A directory shared by a whole test session (cached reference runs), by all its workers
    under pytest-xdist (each worker's base temp is a child of the session's)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "session"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("session")
from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (session fixture)


def pytest_collection_modifyitems(config, items):
    """The slow tests first (the order is otherwise kept): on two xdist workers the long ones
    then start early, instead of one worker finishing a long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
