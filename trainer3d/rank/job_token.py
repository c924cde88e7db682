"""The mark every process of a local job carries: ``TRAINER3D_JOB=<token>`` in its environment.

The submitting process puts the token into the environment of the job it starts, and every
process below it inherits it — submitit's controller, the ranks, and whatever they start (a
data worker, wandb's service), including children re-parented after their parent died or that
started a session of their own. ``/proc/<pid>/environ`` holds each process's environment as it
was exec'd (proc(5)), so a job's processes are found by the mark, not by the process tree:
the submitting process ends them (trainer3d/launch/interrupt.py) and the run lock names those
still holding a run dir (trainer3d/rank/runlock.py).
"""

import os
import uuid
from pathlib import Path
from typing import List

TOKEN_VAR = "TRAINER3D_JOB"


def new_token() -> str:
    return uuid.uuid4().hex


def processes_with_token(token: str) -> List[int]:
    """Live processes (not this one) whose environment carries ``TRAINER3D_JOB=token``."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found
