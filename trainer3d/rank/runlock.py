"""One run per run dir: an exclusive lock held for the run's lifetime.

Two runs writing one run dir interleave their metrics.jsonl rows and overwrite each
other's checkpoints. So a run takes ``flock(LOCK_EX | LOCK_NB)`` on ``<run_dir>/run.lock``
before anything launches and keeps it until it ends: the submitting process holds it for
local runs; rank 0 holds it inside the job for Slurm and in-place runs, so a requeued Slurm
job takes it again after the previous attempt died. The lock file also records who holds it
(pid, host, job id, start time), which is what a refused second run prints.

A holder that dies, however it dies, releases the lock: the kernel drops a flock with the
last descriptor of the open file (flock(2)); a stale record is simply overwritten. On NFS,
Linux emulates flock with byte-range locks, which the server arbitrates between nodes.

A local job is held by its own processes too, not only by the process that submitted it: a
submitting process killed with SIGKILL must not free the run dir while its ranks still run
(a second start beside them would interleave metrics and prune the other's checkpoints). So
before submitting, the submitting process turns its exclusive lock into a shared one
(``share``), and every local rank takes a shared lock of its own as it starts (``join``):
another start's exclusive request is refused while any of them lives, and the refusal names
the job — its submitting process (alive or gone) and the job's processes still running,
found by the job's token (trainer3d/launch/interrupt.py).

A run writes its checkpoints where ``checkpoint.dir`` says, which may lie outside the run dir;
two runs pruning and resuming one checkpoint dir are the same collision as two runs in one run
dir. So the lock covers the checkpoint dir too (``for_run``): a ``run.lock`` in each directory,
all taken, shared and released together, a refusal naming the directory that is held.
"""

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import List, Optional

from trainer3d.checkpoint.store import checkpoint_root
from trainer3d.config.schema import Config
from trainer3d.rank.job_token import processes_with_token

LOCK_NAME = "run.lock"


class RunDirBusy(RuntimeError):
    """Another run holds the run dir."""


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def describe_holder(record: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"])) \
        if isinstance(record.get("started"), (int, float)) else "?"
    job = f", job {record['job_id']}" if record.get("job_id") else ""
    said = f"pid {record.get('pid', '?')} on host {record.get('host', '?')}{job}, started {started}"
    if record.get("host") == socket.gethostname() and not _alive(record.get("pid")):
        said += ", which has exited"
    token = record.get("token")
    if isinstance(token, str) and token and record.get("host") == socket.gethostname():
        left = processes_with_token(token)
        if left:
            said += f"; its processes still running: pid {', '.join(map(str, sorted(left)[:8]))}"
    return said


def run_dirs(cfg: Config) -> List[str]:
    """The directories a run owns: its run dir, and its checkpoint dir where that lies outside."""
    run_dir, root = Path(cfg.run_dir).expanduser().resolve(), checkpoint_root(cfg).expanduser().resolve()
    return [str(run_dir)] if root == run_dir or run_dir in root.parents else [str(run_dir), str(root)]


def _what(index: int, directory: Path) -> str:
    return f"run dir {directory}" if index == 0 else f"checkpoint dir {directory} (checkpoint.dir)"


class RunDirLock:
    """``RunDirLock(run_dir).acquire()`` or RunDirBusy naming the holder; ``release()`` at the end.
    ``RunDirLock.for_run(cfg)``: the run dir and the checkpoint dir."""

    def __init__(self, run_dir: str, *more: str):
        self.run_dir = Path(run_dir)
        self.dirs = [self.run_dir, *map(Path, more)]
        self.path = self.run_dir / LOCK_NAME
        self._fds: List[int] = []

    @classmethod
    def for_run(cls, cfg: Config) -> "RunDirLock":
        return cls(*run_dirs(cfg))

    @property
    def _fd(self) -> Optional[int]:
        return self._fds[0] if self._fds else None

    def acquire(self, job_id: Optional[str] = None) -> "RunDirLock":
        for index, directory in enumerate(self.dirs):
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                self.release()
                knob = "hydra.run.dir" if index == 0 else "checkpoint.dir"
                raise RunDirBusy(f"{_what(index, directory)} is in use by another run ({describe_holder(holder)}); "
                                 f"wait for it to end, or give this run its own {knob}=...") from None
            self._fds.append(fd)
        self.record(job_id)
        return self

    def record(self, job_id: Optional[str], token: Optional[str] = None) -> None:
        """Write who holds the lock (again, once the job id is known; ``token``: the job's)."""
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job_id": job_id,
                           "token": token, "started": time.time()}).encode()
        for fd in self._fds:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)

    def share(self) -> None:
        """Hold the lock shared from now on, so the job's ranks can hold it with us (``join``)."""
        for fd in self._fds:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def check_free(self) -> None:
        """Raise RunDirBusy if another run holds the lock; hold nothing afterwards."""
        self.acquire()
        self.release()

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the last descriptor drops the flock
        self._fds = []

    def __enter__(self) -> "RunDirLock":
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def join(run_dir: str, *more: str) -> List[int]:
    """A rank of a local job: hold the locks of the run dir (and ``more``: its checkpoint dir)
    shared for this process's lifetime (the descriptors returned are never closed: the kernel
    drops the locks when the process ends), or RunDirBusy if another start holds one exclusively."""
    fds = []
    for index, directory in enumerate([run_dir, *more]):
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirBusy(f"{_what(index, Path(directory))} was taken by another run "
                             f"({describe_holder(holder)})") from None
        fds.append(fd)
    return fds


def _read(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}
