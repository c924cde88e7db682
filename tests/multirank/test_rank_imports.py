"""A rank forked from the forkserver (trainer3d/launch/local_ranks.py) imports nothing as it trains.

The server imports torch and the engine once (its ``_PRELOAD``) so that every in-process rank
starts without paying for them; a module the rank's body imports lazily and the server does not
(the planner's step, the pipeline's schedules, numpy.ma on the sampler's first ``numpy.unique``)
is imported again by every rank of every run, ~0.8 s of CPU each on this suite's machines. One
step on pp2 (the schedules on the path) with the defaults a parity run keeps (evaluation, the
final checkpoint) lists what the rank's ``sys.modules`` gained while it trained.
"""

import sys

import pytest

from tests.support.runs import PARITY, _train_rank, configure
from trainer3d.launch.local_ranks import run_ranks


def _modules_imported_while_training(rank: int, world_size: int, cfg) -> list:
    before = set(sys.modules)
    _train_rank(rank, world_size, cfg)
    return sorted(set(sys.modules) - before)


@pytest.mark.timeout(300)
def test_a_forked_rank_imports_nothing_as_it_trains(tmp_path):
    cfg = configure(tmp_path, [*PARITY, "parallel=single", "parallel.pp=2", "train.max_steps=1",
                               "train.eval_every=1", "train.eval_steps=1", "checkpoint.save_final=true"])
    gained = run_ranks(_modules_imported_while_training, 2, cfg, timeout=240)
    assert gained == [[], []], ("modules a rank imported while it trained (add them to "
                                f"trainer3d/launch/local_ranks.py's _PRELOAD): {gained}")
