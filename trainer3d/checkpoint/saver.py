"""Writing one checkpoint, on every rank, in the loop or in the background; publishing it.

``write`` is the whole save after the state is in hand: rank 0 clears a stale
``step_N.partial/``; every rank writes its pieces with DCP, hashing each file on its way
and reading it back from storage (trainer3d/checkpoint/writer.py); a gather of the digests
to rank 0 proves every rank's files are complete; rank 0 writes the marker, renames the
directory to ``step_N/`` (trainer3d/checkpoint/store.py) and prunes to ``checkpoint.keep``;
a broadcast of its outcome tells every rank whether the checkpoint was published. A crash
anywhere before the rename leaves only the ``.partial`` directory, which ``auto`` never
picks and the next save removes.

Every collective of a save runs over a gloo group of its own (``SaveGroups.write``), with
the start-up/I/O timeout: a save in the background then never shares a group with the
training step's collectives, which run at the same time from the main thread (two threads
issuing collectives on one group would interleave them). That is DCP's own requirement for
``async_save`` (a CPU backend; torch/distributed/checkpoint/state_dict_saver.py).

``Background`` runs ``write`` in a daemon thread — what DCP's ``async_save`` does with
``AsyncCheckpointerType.THREAD`` (torch/distributed/checkpoint/_async_thread_executor.py),
with the publication added after it. A thread rather than DCP's checkpoint process: the
state is already in host memory (trainer3d/checkpoint/staging.py) and the writing, hashing
(xxHash) and file I/O release the GIL, so a process would add a copy of the state into
shared memory and a process group of its own per save for nothing (measured in
docs/checkpoints.md). Daemon, so that a rank whose peers died does not hang at exit on a
save that can never finish.

The thread first makes the rank's GPU its current device: CUDA's current device belongs to
the thread and starts at device 0 in a new one, and DCP's file writer takes
``torch.cuda.current_stream()`` there whenever CUDA is available
(torch/distributed/checkpoint/filesystem.py, ``_OverlappingCpuLoader``), so without it every
rank would open a context on GPU 0 at its first background save.

The ranks learn that a background save finished at the same step boundary: each starts a
non-blocking all-reduce (MIN) of "mine is done" over a second gloo group at every boundary
while a save is in flight and reads the result at the next one, as trainer3d/checkpoint/stop.py
agrees on a stop; a failed save is then raised on every rank at the same step.
"""

import concurrent.futures
import dataclasses
import datetime
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer3d.checkpoint import store
from trainer3d.checkpoint.store import CheckpointError
from trainer3d.checkpoint.writer import CheckpointWriter


@dataclasses.dataclass
class SaveGroups:
    """The two gloo groups of the checkpointer (every rank builds them, in the same order)."""

    write: Optional[dist.ProcessGroup]
    """Every collective of a save (DCP's plan and finish, the digests' gather, the outcome)."""
    check: Optional[dist.ProcessGroup]
    """The main thread's non-blocking "is the background save done everywhere" all-reduce."""

    @classmethod
    def build(cls, io_timeout: datetime.timedelta, step_timeout: datetime.timedelta) -> "SaveGroups":
        if not dist.is_initialized():
            return cls(None, None)
        return cls(dist.new_group(backend="gloo", timeout=io_timeout),
                   dist.new_group(backend="gloo", timeout=step_timeout))


@dataclasses.dataclass
class SaveJob:
    """One checkpoint to write: the state (live views, or staged host copies) and its marker."""

    step: int
    state: Dict[str, object]
    root: Path
    info: Dict[str, object]
    """The marker's fields (step, layout, dtype, config); the files' digests are added."""
    keep: int
    known_bad: List[Path]

    @property
    def final(self) -> Path:
        return store.step_dir(self.root, self.step)


@dataclasses.dataclass
class SaveReport:
    """What one save cost the loop, and the writing behind it."""

    step: int
    path: Path
    stall_s: float
    """Seconds the training loop stood still for this save (staging, or the whole save)."""
    write_s: Optional[float] = None
    """Seconds the writing, hashing, read-back and publication took (None: still running)."""


def write(job: SaveJob, group: Optional[dist.ProcessGroup], rank: int) -> Path:
    """Write ``job`` on every rank and publish it (rank 0); the published path, or the error on
    every rank (then nothing is published and rank 0 has removed the partial directory)."""
    partial = store.partial_dir(job.root, job.step)
    try:
        if rank == 0:
            job.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a crash: start clean
                shutil.rmtree(partial)
        _barrier(group)
        writer = CheckpointWriter(str(partial))
        dcp.save(job.state, storage_writer=writer, process_group=group, no_dist=group is None)
        files = _gather(writer.digests, group, rank)  # also proves every rank's files are complete
        outcome: List[Optional[str]] = [None]
        if rank == 0:
            try:
                info = {**job.info, "files": {name: d for rank_files in files for name, d in rank_files.items()}}
                store.publish(partial, job.final, info)
                store.prune(job.root, job.keep, [p for p in job.known_bad if p != job.final])
            except Exception as err:  # every rank must learn that nothing was published
                outcome[0] = f"publishing {job.final} failed: {type(err).__name__}: {err}"
        if group is not None:
            dist.broadcast_object_list(outcome, src=0, group=group)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
    except BaseException:  # DCP's CheckpointException is one: a failed save must not fill the disk
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return job.final


def _barrier(group: Optional[dist.ProcessGroup]) -> None:
    if group is not None:
        dist.barrier(group=group)


def _gather(digests: dict, group: Optional[dist.ProcessGroup], rank: int) -> List[dict]:
    if group is None:
        return [digests]
    files = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(digests, files, dst=0, group=group)
    return files or []


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for other devices):
    the current device is per thread, so a new thread starts on device 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _yield_the_cpu() -> None:
    """Lower the calling thread's CPU priority to nice 19: where the training saturates the
    host's cores (CPU training, data workers), the background save takes the time the loop
    leaves idle instead of slowing its steps. On Linux the nice value belongs to the thread
    (setpriority(2), NOTES), so the loop's own thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the save runs at the loop's priority
        pass


class Background:
    """At most one save in flight: ``start`` it, ``poll`` at every step boundary (every rank,
    the same boundaries), ``wait`` where the loop must not go on without it."""

    def __init__(self, groups: SaveGroups, rank: int, say: Callable[[str], None], device: torch.device):
        self.groups, self.rank, self.say = groups, rank, say
        if device.type == "cuda" and device.index is None:  # set_device refuses "cuda" without an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        """This rank's device, made the save thread's current one before DCP runs there."""
        self.inflight: Optional[SaveReport] = None
        self._future: Optional[Future] = None
        self._check: Optional[dist.Work] = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._thread: Optional[threading.Thread] = None

    def start(self, job: SaveJob, report: SaveReport) -> None:
        assert self.inflight is None, "one save in flight at most: wait() first"
        future: Future = Future()
        self.inflight, self._future = report, future
        started = time.perf_counter()

        def run() -> None:
            try:
                use_device(self.device)
                _yield_the_cpu()
                path = write(job, self.groups.write, self.rank)
                report.write_s = time.perf_counter() - started
                future.set_result(path)
            except BaseException as err:  # noqa: B902 - handed to the loop, raised there on every rank
                report.write_s = time.perf_counter() - started
                future.set_exception(err)

        self._thread = threading.Thread(target=run, name=f"trainer3d-checkpoint-{job.step}", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[SaveReport]:
        """At a step boundary: the in-flight save's report once every rank's part is done (agreed
        one boundary late, the same on every rank; its error raised then), else None."""
        if self.inflight is None:
            return None
        everywhere = False
        if self._check is not None:
            self._check.wait()
            everywhere, self._check = bool(self._flag.item()), None
        if everywhere:
            return self._finish()
        self._flag.fill_(int(self._future.done()))
        if self.groups.check is None:
            everywhere = bool(self._flag.item())
            return self._finish() if everywhere else None
        self._check = dist.all_reduce(self._flag, op=dist.ReduceOp.MIN, group=self.groups.check, async_op=True)
        return None

    def wait(self, why: str, timeout_s: Optional[float] = None, quiet_s: float = 2.0) -> Optional[SaveReport]:
        """Block until the in-flight save is done (every rank calls it at the same step): its
        report, or its error. One line says so when it takes longer than ``quiet_s``.
        ``timeout_s``: give up after that long (TimeoutError; the save is left unpublished)."""
        if self.inflight is None:
            return None
        if self._check is not None:  # settle the pending check: every rank started the same ones
            self._check.wait()
            self._check = None
        if not concurrent.futures.wait([self._future], timeout=quiet_s).done:
            self.say(f"{why} waits for the checkpoint of step {self.inflight.step} to finish writing")
            rest = None if timeout_s is None else max(0.0, timeout_s - quiet_s)
            if not concurrent.futures.wait([self._future], timeout=rest).done:
                raise TimeoutError(f"the checkpoint of step {self.inflight.step} did not finish writing within "
                                   f"{timeout_s:.0f} s; it stays unpublished")
        return self._finish()

    def _finish(self) -> SaveReport:
        """The save is done: its thread is joined too. After setting the result the thread still
        frees the staged copy, and a daemon thread that needs the GIL back once the interpreter
        is finalizing is ended by pthread_exit, whose forced unwind through torch's C++ frees
        calls std::terminate: a complete run would abort at exit (SIGABRT, "terminate called
        without an active exception"; CPython gh-87135)."""
        report, future, thread = self.inflight, self._future, self._thread
        self.inflight, self._future, self._thread = None, None, None
        thread.join()  # only the thread's epilogue is left: its result is set
        future.result()  # raises the save's error
        return report
