"""Per-rank heartbeats: which rank stopped making progress, read from outside the job.

Each rank owns one small file, ``<run_dir>/heartbeat/rank<r>``. A daemon thread rewrites
it every ``BEAT_S`` seconds in place (one ``pwrite`` of a fixed-size JSON record: no
rename, no fsync, no new directory entry) with the rank's host, pid, Slurm attempt, the
steps it has completed and a beat counter. The training loop only stores an integer
(``heartbeat.step = n``) at each step boundary, so the cost per step is one attribute
store; the thread's write once a second is the whole I/O cost.

A rank blocked in a collective keeps beating (the collective waits with the GIL
released), a rank stopped with SIGSTOP, frozen, killed or on a lost node does not. So
when the job fails or stalls, the rank whose beat stopped is the cause and the ranks
timing out in collectives are its victims. The follower (``trainer3d.launch.follow``) judges
age by its own clock — when it last saw a beat counter change — so clocks of different
nodes never need to agree.

A record also names its job (``TRAINER3D_JOB``, trainer3d/rank/job_token.py): a job killed
with SIGKILL leaves its records "running", and a follower of the next job in the same run
dir (a restart after the kill) given its own job's mark ignores them, where it would
otherwise count the dead job's silence against ranks still starting. Under Slurm the record
also names the Slurm job (``slurm_job``, from the rank's own environment, which every Slurm
task has whatever the sbatch template exports): the ranks of a lost node leave their records
"running", and the follower of the resubmitted job reads only its own job's.
"""

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from trainer3d.rank.job_token import TOKEN_VAR

BEAT_S = 1.0
"""Seconds between two writes of a rank's record."""
STALE_S = 10.0
"""A running rank whose beat has not changed for this long is stopped, frozen, dead or unreachable
(ten missed beats: far beyond a thread's scheduling delay on a loaded machine)."""
RECORD_BYTES = 512
"""Every record is padded to this size, so a shorter one overwrites a longer one whole: the
longest (a 64-byte host name, Linux's HOST_NAME_MAX; a 32-digit job mark; a Slurm array job's
id) is about 320 bytes."""


def heartbeat_dir(run_dir: str) -> Path:
    return Path(run_dir) / "heartbeat"


def slurm_job() -> Optional[str]:
    """This process's Slurm job as submitit names it (``<array>_<task>`` in an array), or None."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def attempt() -> int:
    """Which attempt of a requeued Slurm job this process belongs to (0 outside Slurm)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


class Heartbeat:
    """Rank side: ``start()`` once, set ``.step`` at every step boundary, ``stop()`` at exit."""

    def __init__(self, directory: Path, rank: int, interval_s: float = BEAT_S):
        self.path = Path(directory) / f"rank{rank}"
        self.rank, self.interval_s = rank, interval_s
        self.step = 0
        """Steps completed; the training loop sets it (a plain store, read by the writer thread)."""
        self._fd: Optional[int] = None
        self._beats = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer3d-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._write("running")
        self._thread.start()
        return self

    def _write(self, state: str) -> None:
        self._beats += 1
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "attempt": attempt(),
                  "job": os.environ.get(TOKEN_VAR), "slurm_job": slurm_job(),
                  "step": self.step, "state": state, "beat": self._beats, "time": time.time()}
        data = json.dumps(record).encode().ljust(RECORD_BYTES)
        os.pwrite(self._fd, data, 0)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self._write("running")
            except OSError:  # a full or vanished disk must not kill the rank; the beat just goes stale
                pass

    def stop(self) -> None:
        """The rank is leaving (returned, raised or exited): mark it so it is never taken for a hang."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s)
        if self._fd is not None:
            try:
                self._write("exited")
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


@dataclass
class Beat:
    rank: int
    host: str
    pid: int
    attempt: int
    step: int
    state: str
    beat: int
    seen_change: float
    """The reader's monotonic clock when this record's beat counter last changed."""

    def age(self, now: float) -> float:
        return now - self.seen_change


class HeartbeatReader:
    """Follower side: the newest record of every rank, with the age of its beat by our clock.

    ``job``: the followed job's mark, ``slurm_job`` its Slurm job id; records another job wrote
    are not this job's ranks (None: every record counts)."""

    def __init__(self, directory: Path, num_ranks: int, job: Optional[str] = None, slurm_job: Optional[str] = None):
        self.directory, self.num_ranks, self.job, self.slurm_job = Path(directory), num_ranks, job, slurm_job
        self.beats: Dict[int, Beat] = {}

    def read(self) -> Dict[int, Beat]:
        """Re-read every rank's record; returns those of the newest attempt seen."""
        now = time.monotonic()
        for rank in range(self.num_ranks):
            try:
                record = json.loads((self.directory / f"rank{rank}").read_bytes().rstrip(b" \0") or b"null")
            except (OSError, ValueError):  # not written yet, or caught mid-write: keep the last one
                continue
            if not isinstance(record, dict) or not self._ours(record):
                continue
            old = self.beats.get(rank)
            key = (record["pid"], record["beat"], record["state"])
            changed = old is None or (old.pid, old.beat, old.state) != key
            self.beats[rank] = Beat(rank=rank, host=record["host"], pid=record["pid"], attempt=record["attempt"],
                                    step=record["step"], state=record["state"], beat=record["beat"],
                                    seen_change=now if changed else old.seen_change)
        newest = max((b.attempt for b in self.beats.values()), default=0)
        return {r: b for r, b in self.beats.items() if b.attempt == newest}

    def _ours(self, record: dict) -> bool:
        return ((self.job is None or record.get("job") == self.job)
                and (self.slurm_job is None or record.get("slurm_job") == self.slurm_job))

    def stale(self, now: Optional[float] = None, after_s: float = STALE_S) -> Dict[int, Beat]:
        """Running ranks of the newest attempt whose beat stopped ``after_s`` ago or more."""
        now = time.monotonic() if now is None else now
        return {r: b for r, b in self.read().items() if b.state == "running" and b.age(now) >= after_s}
