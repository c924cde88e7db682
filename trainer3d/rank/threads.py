"""The CPU threads of one rank: torch's intra-op pool, OpenMP in the processes it starts, and
inductor's compile workers, sized from the cores this rank may run on.

Every rank runs host work on threads: the whole step on a CPU rank; on a CUDA rank the host
AdamW of ZeRO-0/1 offload (its kernel splits over torch's intra-op threads,
trainer3d/parallel/zero/host_kernel.py), FSDP2's CPU AdamW under ZeRO-2/3 offload, the data
reader and inductor's compilation. Left alone, each of a node's eight ranks starts a pool the
size of its whole affinity mask (OpenMP's default), eight times the cores there are, and
OpenMP's threads wait for one another at the end of every parallel region.

The cores are the affinity mask (``os.sched_getaffinity``: taskset, cgroups, Slurm's task
binding), never ``os.cpu_count()``, which counts the whole machine. Where Slurm bound each task
to its own cores (``--cpus-per-task``, the mask no larger than ``SLURM_CPUS_PER_TASK``) the mask
is this rank's alone; otherwise (the local launcher, torchrun, a step without binding) the
node's ``LOCAL_WORLD_SIZE`` ranks share it.
"""

import os
import sys
from typing import Mapping, MutableMapping, Optional

import torch


def affinity_cores() -> int:
    """How many cores this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def rank_share(cores: int, local_world: int, cpus_per_task: Optional[int] = None) -> int:
    """This rank's part of the ``cores`` of its affinity mask: all of them where Slurm gave the
    task its own (``cpus_per_task`` set and the mask no larger), else an equal part among the
    ``local_world`` ranks that share the mask; at least one."""
    if cpus_per_task and cores <= cpus_per_task:
        return max(1, cores)
    return max(1, cores // max(1, local_world))


def cpu_threads(share: int, env: Mapping[str, str] = os.environ) -> int:
    """Torch's intra-op threads: ``OMP_NUM_THREADS`` where it is set (the cores the user,
    torchrun or a test session gives each process), else ``share``. A rank with more threads
    than the cores free to it stalls whenever another process holds one (a 20-step tiny run
    beside one busy process: 5 s on 1 thread, minutes on 2)."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else share


def _positive(value: Optional[str]) -> Optional[int]:
    value = (value or "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def set_host_threads(env: MutableMapping[str, str] = os.environ) -> int:
    """Size this rank's threads (CPU and CUDA ranks alike); returns torch's intra-op count.

    ``OMP_NUM_THREADS`` is set where the user did not, for the processes the rank starts
    (inductor's compile workers and anything else that loads OpenMP); inductor compiles on the
    rank's share (``TORCHINDUCTOR_COMPILE_THREADS``, where set, is the user's and stays)."""
    share = rank_share(affinity_cores(), _positive(env.get("LOCAL_WORLD_SIZE")) or 1,
                       _positive(env.get("SLURM_CPUS_PER_TASK")))
    threads = cpu_threads(share, env)
    torch.set_num_threads(threads)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if "TORCHINDUCTOR_COMPILE_THREADS" not in env:
        _compile_threads(share, env)
    return threads


def _compile_threads(share: int, env: MutableMapping[str, str]) -> None:
    """Inductor compiles on ``share`` threads. Its config reads TORCHINDUCTOR_COMPILE_THREADS
    when first imported (torch/_inductor/config.py, ``decide_compile_threads``); importing it
    here would cost every rank torch._inductor's import (about 2 s of CPU), which only
    ``train.compile`` needs: the variable is set for a later import, and the config as well
    where it is loaded already."""
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(share)
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = share
