"""The multi-rank test harness: ``run_ranks`` (trainer3d/launch/local_ranks.py: a function on N gloo
ranks on loopback, results or the first rank's traceback, bounded by a timeout) and the
layout of the rank it runs in.

    results = run_ranks(fn, world_size, *args, timeout=60)
"""

import torch

from trainer3d.launch.local_ranks import preload, run_ranks  # noqa: F401  (the tests' entry point)
from trainer3d.parallel.topology import ParallelDims, Topology

# A rank unpickles its function by name, importing the test module it lives in, and with it
# pytest, xdist and the session's conftest (tests/support/runs.py imports them): the forkserver
# imports them once per session instead of every rank of every run (pytest alone is ~0.1 s of
# CPU a rank). pytest imports every test module before the first test runs, so this module's
# import comes before the server starts.
preload("pytest", "tests.conftest", "tests.support.runs")


def dims_for(tp: int = 1, pp: int = 1, dp: int = 1, tied_embeddings: bool = False, cp: int = 1,
             v_shape: bool = False, ep: int = 1) -> ParallelDims:
    """This rank's ParallelDims on CPU (call inside a rank); ``v_shape``: a V schedule's placement
    (the last stage on pp rank 0); ``ep``: expert parallelism's groups."""
    return ParallelDims.build(Topology(tp=tp, pp=pp, dp=dp, cp=cp, v_shape=v_shape, ep=ep), torch.device("cpu"),
                              tied_embeddings)
