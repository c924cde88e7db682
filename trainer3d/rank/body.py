"""Each rank's body: the process group, the layout and the trainer (``run_rank``), run by
``TrainTask`` (trainer3d/rank/task.py) inside each task, after its environment, heartbeat and
owner watch are set up.

The process group starts with an explicit timeout, so a dead peer ends the job instead of
hanging it for gloo's default 30 minutes (trainer3d/parallel/timeouts.py).
"""

import os
from typing import Optional

import torch
import torch.distributed as dist

from trainer3d.config.device import exact_pinned_sizes, rank_device
from trainer3d.config.schema import Config
from trainer3d.cpu.malloc import keep_freed_memory
from trainer3d.parallel.timeouts import seconds
from trainer3d.parallel.topology import ParallelDims, Topology
from trainer3d.plan.predict import predict_step
from trainer3d.rank.heartbeat import Heartbeat
from trainer3d.rank.preemption import leave
from trainer3d.rank.runlock import RunDirBusy, RunDirLock
from trainer3d.rank.threads import set_host_threads
from trainer3d.trainer import Trainer


def init_distributed(cfg: Config) -> torch.device:
    """Initialise the default process group from the environment; return this rank's device.

    The group starts with the start-up timeout (``parallel.init_timeout_s``); the trainer
    switches to the step's after the first step (trainer3d/parallel/timeouts.py)."""
    device = rank_device(cfg)
    use_cuda = device.type == "cuda"
    set_host_threads()  # the node's ranks share its cores (trainer3d/rank/threads.py)
    if use_cuda:
        torch.cuda.set_device(device)
        exact_pinned_sizes()  # before the first pinned buffer
    else:
        keep_freed_memory()
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=seconds(cfg.parallel.init_timeout_s),
                                device_id=device if use_cuda else None)
    return device


def run_rank(cfg: Config, heartbeat: Optional[Heartbeat] = None, lock_run_dir: bool = False):
    """The body of every rank: process group, layout, trainer. Returns rank 0's summary.

    ``lock_run_dir``: rank 0 takes the run dir's lock (Slurm and in-place runs, where no
    submitting process holds it); every rank fails alike when another run holds it."""
    device = init_distributed(cfg)
    lock = None
    try:
        if lock_run_dir:
            lock = _lock_on_rank0(cfg)
        p = cfg.parallel
        dims = ParallelDims.build(Topology.of(p), device, cfg.model.tie_embeddings,
                                  timeout_s=p.init_timeout_s)
        trainer = Trainer(cfg, dims, prediction=predict_step(cfg, dims))
        trainer.heartbeat = heartbeat
        summary = trainer.train()
        if trainer.stopped is not None:  # SIGUSR2/SIGTERM: every rank stopped at the same step
            leave(trainer.stopped, trainer.stop_signal, dims.rank, cfg)
        return summary
    finally:
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def _lock_on_rank0(cfg: Config) -> Optional[RunDirLock]:
    """Rank 0 takes the run dir's lock; all ranks learn whether it could (one broadcast)."""
    lock, refusal = None, [None]
    if dist.get_rank() == 0:
        try:
            lock = RunDirLock.for_run(cfg).acquire(job_id=os.environ.get("SLURM_JOB_ID"))
        except RunDirBusy as err:
            refusal[0] = str(err)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunDirBusy(refusal[0])
    return lock
