"""Run a function on N gloo ranks of this machine and collect what each returns.

    results = run_ranks(fn, 4, *args, timeout=120)

The benchmarks in tools/ and the multi-rank tests use it to exercise the engine's pieces on
real process groups without the launcher. ``fn(rank, world_size, *args)`` must be a
module-level function (it is pickled by name). Ranks are forked from a forkserver that has
torch and the engine (trainer3d.rank.task, the trainer, FSDP, DTensor and pipelining) imported
already, so a rank starts in milliseconds instead of the seconds those imports cost. The first rank that raises makes ``run_ranks`` raise with that
rank's traceback and the others are killed; a run that outlives ``timeout`` is killed and
reported, never left hanging.
"""

import datetime
import functools
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist


# The engine imports the loop (with DCP) only as a rank runs, FSDP2 only for ZeRO-2/3,
# pipelining (and with it torch._dynamo) only for a pp > 1 layout, and torch's C++ builder
# (with setuptools: 0.3-0.5 s of CPU) where it builds a CPU library, not where it loads a
# finished one (trainer3d/cpu/build.py); its ranks here run every layout, so the server pays for them
# once. The libraries themselves load in each rank (a test may take one away). The rank's body
# (trainer3d/rank/body.py) imports the planner's step and the loop, and the pipeline's schedules as it runs,
# and numpy imports numpy.ma on the sampler's first ``numpy.unique``: ~0.8 s of CPU a rank
# where the server has not; torch.save and torch.load import torch.utils.serialization on first
# use (torch/serialization.py).
# tests/multirank/test_rank_imports.py holds a rank to importing nothing as it trains.
_PRELOAD = ["torch", "torch.distributed", "trainer3d.rank.task", "trainer3d.rank.body", "trainer3d.trainer", "trainer3d.plan.predict",
            "trainer3d.parallel.pipeline.schedule", "torch.distributed.fsdp", "torch.distributed.pipelining",
            "torch.utils.cpp_extension", "numpy.ma", "torch.utils.serialization"]


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, once, before it forks a rank: the modules a
    caller's rank functions live in import them again in every rank otherwise, as each rank
    unpickles its function by name (a test module's ``import pytest``). Takes effect where it
    is called before this process's first ``run_ranks``, which starts the server."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


@functools.lru_cache(maxsize=None)
def _context():
    """One forkserver per process, started on first use."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _rank_main(fn, rank, world_size, init_file, results, threads, pg_timeout_s, args):
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        _leave_together()
    except BaseException:  # noqa: B902 - report everything, including SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def received(item: Tuple[int, str, Any]) -> Tuple[int, str, Any]:
    """A rank's report as read from the queue: (rank, "ok", what it returned) or (rank, "error",
    its traceback). What a rank returns travels pickled by value: the queue's own pickler would
    pass a tensor's storage as a file descriptor that the receiver fetches from the sending
    process, which may have exited by then ("No such file or directory" in resource_sharer)."""
    rank, status, value = item
    return rank, status, pickle.loads(value) if status == "ok" else value


def _leave_together():
    """A rank that is done waits for the others before it exits: one that left while a peer was
    still inside a collective this rank had already finished (a new group's connect handshake,
    a ring's last send) would close that peer's socket under it ("Connection closed by peer").
    A peer that fails exits instead of arriving, which ends this wait; its own report says why."""
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - the failing peer reports its own error
        pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120, threads: int = 1,
              pg_timeout_s: float = 60) -> List[Any]:
    """``fn``'s return value on every rank, in rank order. ``threads``: torch threads per rank;
    ``pg_timeout_s``: the process group's timeout (a collective waiting on a dead peer fails
    after it)."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, init_file, results, threads, pg_timeout_s, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            out = _collect(results, procs, timeout)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]


def _collect(results, procs, timeout: float) -> dict:
    out: dict = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(out))} did not finish within {timeout}s")
        try:
            rank, status, value = received(results.get(timeout=min(remaining, 1.0)))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out[rank] = value
    return out
