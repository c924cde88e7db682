import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

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


# Test files whose tests must run on one xdist worker, one after another: the Slurm tests share
# the session's one cluster (a lost-node test restarts a node under any job running on it),
# the others share a module fixture that would otherwise run once per worker, or a run made
# once per session that a test on the other worker would sit waiting for (the parity tool's). pytest-xdist's
# own marks (``xdist_group`` with ``--dist loadgroup``) stopped grouping on pytest 9.2: it
# renames node ids, which pytest no longer reads back (pytest-dev/pytest-xdist#1386).
XDIST_GROUPS = {"tests/test_slurm.py": "slurm", "tests/test_slurm_two_nodes.py": "slurm",
                "tests/test_hf.py": "hf", "tests/test_eval.py": "eval", "tests/test_train_dp.py": "train_dp",
                "tests/test_parity_tool.py": "parity_tool"}


class FileGroupScheduling(LoadScopeScheduling):
    """``--dist loadgroup`` by XDIST_GROUPS: a grouped file's tests are one work unit (its
    group's), every other test a unit of its own."""

    def _split_scope(self, nodeid: str) -> str:
        return XDIST_GROUPS.get(nodeid.split("::", 1)[0], nodeid)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    return FileGroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None
