"""``train.compile`` runs on in-process ranks, with what each rank compiled.

A compiled layout's parity alone cannot tell a compiled run from one that skipped compilation
(both train the eager model's losses), so each rank also reports the graphs inductor built or
loaded from its cache (``torch._dynamo.utils.counters["inductor"]``: ``fxgraph_cache_miss``
and ``fxgraph_cache_hit``, one per forward or backward graph). A rank is forked from the
harness's forkserver, which compiles nothing, so its counters start at zero.
"""

from pathlib import Path
from typing import List, Sequence, Tuple

from tests.support.runs import _train_rank, configure, train_losses
from trainer3d.config.validate import world_size_of
from trainer3d.launch.local_ranks import run_ranks


def inductor_graphs() -> int:
    """Graphs (forward and backward each) inductor compiled or loaded in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]


def _train_rank_counting(rank: int, world_size: int, cfg) -> int:
    _train_rank(rank, world_size, cfg)
    return inductor_graphs()


def compiled_losses_in_ranks(run_dir: Path, overrides: Sequence[str], timeout: float = 900) -> Tuple[List[float], List[int]]:
    """``losses_in_ranks`` (tests/support/runs.py) of a ``train.compile=true`` run, and each
    rank's count of inductor graphs."""
    cfg = configure(run_dir, overrides)
    assert cfg.train.compile, "a compiled run sets train.compile=true"
    graphs = run_ranks(_train_rank_counting, world_size_of(cfg), cfg, timeout=timeout,
                       pg_timeout_s=cfg.parallel.timeout_s)
    return train_losses(run_dir), graphs
