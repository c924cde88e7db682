"""Shared-memory segments left in /dev/shm by a rank 0 killed during the set-up of its
collectives (trainer3d/cpu/shm.py unlinks the name on every path that process lives through;
SIGKILL or the OOM killer leaves none). The next set-up on the host removes them."""

import os
import time
from typing import List, Optional

PREFIX = "trainer3d-"
LEFTOVER_AGE_S = 3600.0
"""A segment's name lives only through its set-up (seconds; at most the group's timeout): one
older than this whose maker is gone was left by a rank 0 killed during its set-up."""


def sweep_leftovers(directory: str = "/dev/shm", now: Optional[float] = None) -> List[str]:
    """Remove this user's leftover segments from ``directory``: named ``trainer3d-<pid>-...``,
    the process ``pid`` gone, and untouched for ``LEFTOVER_AGE_S``. Both conditions: a pid of
    another PID namespace sharing /dev/shm looks gone here, and a set-up never lasts an hour.
    The names removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not name.startswith(PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < LEFTOVER_AGE_S or _alive(int(pid)):
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
