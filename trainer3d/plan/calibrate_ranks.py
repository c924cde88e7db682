"""The processes ``--calibrate`` (calibrate.py) measures the node with: every rank multiplying
at once, and gloo all-reduces between two ranks (the two-rank node's own ranks, once they have
multiplied: ``rank_matmul`` with a store).

Each rank is forked from a forkserver that has imported this module (and with it torch) and
what the ranks of calibrate.py's engine probes run (trainer3d/plan/probe.py, which forks them
from the same server): these are imported once, by the server, not by every rank of every start
(``--max-ranks 8`` starts 2 + 4 + 8 ranks three times over, then 21 probe ranks).
"""

import datetime
import functools
import multiprocessing as mp
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

MATMUL = 512
"""The side of the square fp32 matrices every matmul figure is measured with."""


def best_matmul_gflops(threads: int, rounds: int, start: Callable[[], None] = lambda: None) -> float:
    """The best of ``rounds`` rounds of 8 fp32 matmuls on ``threads`` threads (``start`` called
    before each round): GFLOP per CPU-second of this process with one thread, or per second with
    several (OpenMP threads spin while they wait for each other: their CPU time overstates the
    work). It leaves torch on ``threads`` threads."""
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    torch.mm(a, b)
    best = 0.0
    for _ in range(rounds):
        start()
        started = clock()
        for _ in range(8):
            torch.mm(a, b)
        best = max(best, 8 * 2 * MATMUL ** 3 / max(clock() - started, 1e-9) / 1e9)
    return best


def rank_matmul(rank: int, world: int, threads: int, rounds: int, store: Optional[str], barrier, out) -> None:
    """Rounds in which every rank multiplies at once (a barrier starts each): puts
    ``("matmul", the best round's rate)`` (``best_matmul_gflops``). With ``store`` (a file
    store's path), the ranks then time gloo all-reduces (``all_reduce_times``) in the same
    processes, and rank 0 puts ``("all_reduce", their times)``."""
    out.put(("matmul", best_matmul_gflops(threads, rounds, barrier.wait)))
    if store is not None:
        times = all_reduce_times(rank, world, store)
        if rank == 0:
            out.put(("all_reduce", times))


def all_reduce_times(rank: int, world: int, store: str, repeats: int = 20) -> Dict[int, float]:
    """The fastest of ``repeats`` gloo all-reduces per size in seconds, by element count (a fixed
    count: every rank must join each), on one thread."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    times = {}
    for numel in (256, 4 * 2 ** 20):
        t = torch.ones(numel)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - started)
        times[numel] = best
    dist.destroy_process_group()
    return times


def rank_all_reduce(rank: int, world: int, store: str, out) -> None:
    """``all_reduce_times`` alone: rank 0 puts them."""
    times = all_reduce_times(rank, world, store)
    if rank == 0:
        out.put(times)


PROBE_MODULES = ("trainer3d.plan.probe", "trainer3d.train", "trainer3d.rank.body",
                 "trainer3d.parallel.pipeline.schedule", "numpy.ma")
"""What a probe's rank runs: the entry point, a rank's body (torch, the loop, the planner's
prediction), the pipeline's schedules (torch.distributed.pipelining: the pp probes) and numpy.ma
(the sampler's first ``numpy.unique`` imports it; trainer3d/launch/local_ranks.py). Named for
the server to import, not imported here (the planner's processes that measure nothing, and
importing this module, stay without them: tests/unit/test_import_cost.py)."""


@functools.lru_cache(maxsize=None)
def forkserver():
    """The forkserver the ranks fork from, started on first use. A process has one forkserver,
    and the modules it preloads are those named before it starts: where one runs already
    (trainer3d/launch/local_ranks.py's, which has the engine imported), the ranks fork from
    that one and import this module as they unpickle their function. The other order, this
    server first and local_ranks' ranks later in the same process, leaves those ranks a server
    without the engine's preloads: they import those as they start (slower, no different)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *PROBE_MODULES])
    return ctx


def run_ranks(target: Callable, ranks: int, *args, results: int = 1) -> List:
    """Start ``ranks`` processes running ``target(rank, ranks, *args, queue)``; the first
    ``results`` things they put on the queue."""
    ctx = forkserver()
    queue = ctx.Queue()
    if target is rank_matmul:
        args = (*args, ctx.Barrier(ranks))
    procs = [ctx.Process(target=target, args=(r, ranks, *args, queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=600) for _ in range(results)]
    for p in procs:
        p.join(timeout=60)
    return out
