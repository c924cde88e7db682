"""The processes ``--calibrate`` (calibrate.py) measures the node with: every rank multiplying
at once, and gloo all-reduces between two ranks.

Each rank is a fresh interpreter (multiprocessing's spawn) that imports this module to find its
function: it imports torch alone, so a rank starts in the time of ``import torch``, not of the
planner and the engine that calibrate.py brings.
"""

import datetime
import multiprocessing as mp
import time
from typing import Callable, List

import torch
import torch.distributed as dist

MATMUL = 512
"""The side of the square fp32 matrices every matmul figure is measured with."""


def rank_matmul(rank: int, world: int, threads: int, rounds: int, barrier, out) -> None:
    """Rounds in which every rank multiplies at once (a barrier starts each): the best round's
    GFLOP per CPU-second of this one-thread process, or per second with several threads
    (OpenMP threads spin while they wait for each other: their CPU time overstates the work)."""
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    torch.mm(a, b)
    best = 0.0
    for _ in range(rounds):
        barrier.wait()
        started = clock()
        for _ in range(8):
            torch.mm(a, b)
        best = max(best, 8 * 2 * MATMUL ** 3 / max(clock() - started, 1e-9) / 1e9)
    out.put(best)


def rank_all_reduce(rank: int, world: int, store: str, out, repeats: int = 20) -> None:
    """The fastest of ``repeats`` all-reduces per size (a fixed count: every rank must join each)."""
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
    if rank == 0:
        out.put(times)


def run_ranks(target: Callable, ranks: int, *args, results: int = 1) -> List:
    """Start ``ranks`` processes running ``target(rank, ranks, *args, queue)``; the first
    ``results`` things they put on the queue."""
    ctx = mp.get_context("spawn")
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
