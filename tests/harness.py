"""Run a function on N gloo ranks on loopback and collect what each returns.

    results = run_ranks(fn, world_size=4, timeout=60, *args)

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by name).
Ranks are forked from a forkserver that has torch imported already, so a rank starts in
milliseconds instead of the seconds an ``import torch`` costs. The first rank that raises
makes ``run_ranks`` raise with that rank's traceback; the others are killed. A run that
outlives ``timeout`` is killed and reported, never left hanging.
"""

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List

_CTX = None


def _context():
    global _CTX  # one forkserver per test session (not a process group: plain test plumbing)
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "trainer3d.topology"])
    return _CTX


def _rank_main(fn, rank, world_size, init_file, results, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: B902 - report everything, including SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> List[Any]:
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, init_file, results, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish "
                                       f"within {timeout}s")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                    continue
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]


def dims_for(tp: int = 1, pp: int = 1, dp: int = 1, tied_embeddings: bool = False):
    """This rank's ParallelDims on CPU (call inside a rank)."""
    import torch
    from trainer3d.topology import ParallelDims, Topology

    return ParallelDims.build(Topology(tp=tp, pp=pp, dp=dp), torch.device("cpu"), tied_embeddings)
