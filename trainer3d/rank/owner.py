"""A local job never outlives its owner, the process that submitted it.

Killed with SIGKILL, the submitting process runs no handler: nothing ends the job it started,
and its ranks would train on unowned, holding the devices and writing the run dir. Two
mechanisms, one for each parent in the chain submitting process -> submitit's controller ->
rank:

- the submitting process puts ``TRAINER3D_OWNER=<pid>:<start time>`` into the job's
  environment; every rank watches it (``OwnerWatch``, a daemon thread, once a second). The
  start time (field 22 of /proc/<pid>/stat, in clock ticks since boot) tells the owner from a
  later process that reused its pid. When the owner is gone the rank sends itself SIGTERM:
  the same agreed stop at the next step boundary as a ``kill`` of the job
  (trainer3d/checkpoint/stop.py), so the ranks save a checkpoint and exit; a rank still alive
  ``GRACE_S`` later (blocked in a collective with a dead peer) is killed;
- every rank asks the kernel for SIGTERM when its own parent, the controller, dies
  (``prctl(PR_SET_PDEATHSIG)``, prctl(2); Linux only: trainer3d/config/parent_death.py, which
  the planner's probe ranks ask too).
"""

import os
import signal
import threading
from typing import Optional

from trainer3d.config.parent_death import die_with_parent

OWNER_VAR = "TRAINER3D_OWNER"
WATCH_S = 1.0
GRACE_S = 60.0
"""After the owner is gone: how long the ranks have to stop at a step boundary and save."""


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (None if it does not exist)."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19].decode() if len(fields) > 19 else None


def owner_id(pid: Optional[int] = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def owner_alive(owner: str) -> bool:
    pid, _, started = owner.partition(":")
    return pid.isdigit() and start_time(int(pid)) == started


class OwnerWatch:
    """``OwnerWatch(owner).start()`` in a rank: SIGTERM to this process once ``owner`` is gone."""

    def __init__(self, owner: str, interval_s: float = WATCH_S, grace_s: float = GRACE_S):
        self.owner, self.interval_s, self.grace_s = owner, interval_s, grace_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer3d-owner", daemon=True)

    def start(self) -> "OwnerWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            if not owner_alive(self.owner):
                os.kill(os.getpid(), signal.SIGTERM)
                if not self._stopped.wait(self.grace_s):
                    os.kill(os.getpid(), signal.SIGKILL)
                return

    def stop(self) -> None:
        self._stopped.set()


def watch_owner() -> Optional[OwnerWatch]:
    """In a rank of a local job (its environment names an owner): both mechanisms; else None."""
    owner = os.environ.get(OWNER_VAR)
    if not owner:
        return None
    die_with_parent()  # SIGTERM; where prctl is refused (not Linux), the owner watch still ends the rank
    return OwnerWatch(owner).start()
