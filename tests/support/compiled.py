"""``train.compile`` runs on in-process ranks, with what each rank compiled and how its gradient
buckets launched.

A compiled layout's parity alone cannot tell a compiled run from one that skipped compilation
(both train the eager model's losses), so each rank also reports the graphs AOTAutograd
compiled, with any ``train.compile_backend`` (``torch._dynamo.utils.counters["aot_autograd"]
["total"]``, one per graph dynamo hands it: a forward and its backward), and of those the
forward and backward graphs inductor built or loaded from its cache (``counters["inductor"]``:
``fxgraph_cache_miss`` and ``fxgraph_cache_hit``), none under aot_eager. A rank is forked from
the harness's forkserver, which compiles nothing, so its counters start at zero.

Nor can it tell whether the post-accumulate hooks of the compiled blocks' parameters fired
(trainer3d/parallel/zero/buckets.py): a bucket no hook launched is launched by
``GradReducer.finish`` after backward, with the same sums. So each rank also reports, for every
step, how many of its buckets their hooks launched inside backward, and how many it has.
"""

from pathlib import Path
from typing import List, NamedTuple, Sequence, Tuple

from tests.support.runs import _train_rank, configure, train_losses
from trainer3d.config.validate import world_size_of
from trainer3d.launch.local_ranks import run_ranks
from trainer3d.parallel.zero.buckets import GradReducer


class CompiledRank(NamedTuple):
    graphs: int
    """Graphs AOTAutograd compiled in the rank (each a forward and its backward)."""
    inductor: int
    """Inductor graphs (forward and backward each) the rank compiled or loaded."""
    launches: List[Tuple[int, int]]
    """Per step: (buckets launched by their hooks inside backward, buckets of the rank)."""


def aot_graphs() -> int:
    """Graphs (a forward and its backward each) AOTAutograd compiled in this process, with any
    backend (torch/_dynamo/backends/common.py counts them)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["total"]


def inductor_graphs() -> int:
    """Graphs (forward and backward each) inductor compiled or loaded in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]


def _train_rank_counting(rank: int, world_size: int, cfg) -> CompiledRank:
    launches: List[Tuple[int, int]] = []
    finish = GradReducer.finish

    def recorded(reducer: GradReducer) -> None:
        launches.append((reducer.launched_in_backward, len(reducer.buckets)))
        finish(reducer)

    GradReducer.finish = recorded  # this forked rank's class only
    try:
        _train_rank(rank, world_size, cfg)
    finally:
        GradReducer.finish = finish
    return CompiledRank(aot_graphs(), inductor_graphs(), launches)


def compiled_losses_in_ranks(run_dir: Path, overrides: Sequence[str], timeout: float = 900) -> Tuple[List[float], List[CompiledRank]]:
    """``losses_in_ranks`` (tests/support/runs.py) of a ``train.compile=true`` run, and each
    rank's ``CompiledRank``."""
    cfg = configure(run_dir, overrides)
    assert cfg.train.compile, "a compiled run sets train.compile=true"
    ranks = run_ranks(_train_rank_counting, world_size_of(cfg), cfg, timeout=timeout,
                      pg_timeout_s=cfg.parallel.timeout_s)
    return train_losses(run_dir), [CompiledRank(*r) for r in ranks]


def hooks_launched_every_bucket(rank: CompiledRank, steps: int) -> bool:
    """Whether, in each of ``steps`` steps, the rank's buckets were all launched by their
    parameters' hooks inside backward (none left to ``finish``): the compiled blocks'
    parameters fired theirs."""
    return len(rank.launches) == steps and all(n == total >= 1 for n, total in rank.launches)
