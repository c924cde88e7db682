"""The processes ``--calibrate`` (calibrate.py) measures the node with: every rank multiplying
at once, and gloo all-reduces between two ranks (the two-rank node's own ranks, once they have
multiplied: ``rank_matmul`` with a store).

Each rank is forked from a forkserver that has imported this module (and with it torch) and
what the ranks of calibrate.py's engine probes run (trainer3d/plan/probe.py, which forks them
from the same server): these are imported once, by the server, not by every rank of every start
(``--max-ranks 8`` starts 2 + 4 + 8 ranks three times over, then 21 probe ranks).

Both kinds of rank are waited for within a deadline and every rank still running is killed
when the wait ends (``wait_ranks``, ``end_ranks``): a hung rank is named, never waited on.
"""

import datetime
import functools
import multiprocessing as mp
import queue as queues
import time
from multiprocessing.connection import wait
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from trainer3d.config.schema_parallel import ParallelConfig

MATMUL = 512
"""The side of the square fp32 matrices every matmul figure is measured with."""
COLLECTIVE_TIMEOUT_S = ParallelConfig.timeout_s
"""The all-reduce ranks' process group timeout: a run's collective timeout, the schema's default
(``parallel.timeout_s``)."""
RANKS_TIMEOUT_S = ParallelConfig.init_timeout_s + COLLECTIVE_TIMEOUT_S
"""How long ``run_ranks`` waits for its ranks before it kills them and names those still running:
a run's bound on its start-up (``parallel.init_timeout_s``, the schema's default) and one
collective timeout, as the engine probes' deadline is those and one a step (probe.py)."""


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
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
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


def run_ranks(target: Callable, ranks: int, *args, results: int = 1, timeout_s: float = RANKS_TIMEOUT_S,
              context=None) -> List:
    """Start ``ranks`` processes running ``target(rank, ranks, *args, queue)``; the first
    ``results`` things they put on the queue, once every rank has exited. A rank that exits
    non-zero raises RuntimeError naming it; ranks still running ``timeout_s`` after the start
    raise TimeoutError naming them; every rank still running then is killed. ``context``: the
    multiprocessing context the ranks start from (default: ``forkserver()``)."""
    ctx = context or forkserver()
    queue = ctx.Queue()
    if target is rank_matmul:
        args = (*args, ctx.Barrier(ranks))
    procs = [ctx.Process(target=target, args=(r, ranks, *args, queue), daemon=True) for r in range(ranks)]
    deadline = time.monotonic() + timeout_s
    bound = f"{timeout_s:g} s (parallel.init_timeout_s + parallel.timeout_s)"
    try:
        for p in procs:
            p.start()
        out = []
        while len(out) < results:  # read before waiting: a rank exits once what it put is written
            try:
                out.append(queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic()))))
                continue
            except queues.Empty:
                pass
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank {failed[0]} of {ranks} exited {procs[failed[0]].exitcode}")
            if all(p.exitcode == 0 for p in procs) and queue.empty():
                raise RuntimeError(f"the ranks exited having put {len(out)} of {results} results")
            if time.monotonic() >= deadline:
                wait_ranks(procs, deadline, bound)  # raises, naming the ranks still running
        failed = wait_ranks(procs, deadline, bound)
        if failed is not None:
            raise RuntimeError(f"rank {failed} of {ranks} exited {procs[failed].exitcode}")
    finally:
        end_ranks(procs)
    return out


def wait_ranks(procs: Sequence, deadline: float, bound: str) -> Optional[int]:
    """Wait for every process of ``procs`` (rank order) until ``deadline`` (``time.monotonic``);
    the first that exited non-zero (its rank), or None. Past the deadline: TimeoutError naming
    the ranks still running and the ``bound`` that set it (the caller kills them: ``end_ranks``)."""
    pending = list(procs)
    while True:
        for p in [p for p in pending if p.exitcode is not None]:
            pending.remove(p)
            if p.exitcode != 0:
                return procs.index(p)
        if not pending:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ranks {[procs.index(p) for p in pending]} of {len(procs)} still running at "
                               f"the deadline, {bound}")
        wait([p.sentinel for p in pending], timeout=remaining)


def end_ranks(procs: Sequence) -> None:
    """Kill every process of ``procs`` that was started and still runs, and reap it: after an
    interrupt, a deadline or a failed rank, none is left running."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.kill()
            p.join()
