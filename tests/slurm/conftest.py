"""The local runs the Slurm tier's jobs must reproduce, each trained once per session on
in-process ranks (tests/support/runs.py train_in_ranks): a layout two tests reproduce (pp2 on
one node in test_slurm.py, pp2 across two nodes in test_slurm_two_nodes.py) is trained once."""

from typing import Dict, List, Tuple

import pytest

from tests.support.runs import read_metrics, train_in_ranks


def losses(run_dir) -> List[float]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows))), "one row per step: none lost, none repeated"
    return [r["loss"] for r in rows]


@pytest.fixture(scope="session")
def local_losses(tmp_path_factory):
    """``local_losses(overrides)``: the per-step losses of ``overrides`` trained on local ranks."""
    done: Dict[Tuple[str, ...], List[float]] = {}

    def run(overrides) -> List[float]:
        key = tuple(overrides)
        if key not in done:
            path = tmp_path_factory.mktemp("local") / "run"
            train_in_ranks(path, list(key))
            done[key] = losses(path)
        return done[key]
    return run
