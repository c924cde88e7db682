"""trainer3d/config/parent_death.py: a process that asked dies when its parent does (the ranks of
a local job, trainer3d/rank/owner.py; --calibrate's probe ranks, trainer3d/plan/probe.py)."""

import os
import signal
import time

from trainer3d.config.parent_death import die_with_parent


def _gone(pid: int) -> bool:
    """No such process, or a zombie (reparented to a pid 1 that may not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_process_that_asked_dies_with_its_parent():
    """The process under test asks for SIGKILL, then sleeps; its parent is killed: the process
    is gone within seconds (without the request it would sleep on, reparented)."""
    ready_r, ready_w = os.pipe()
    parent = os.fork()
    if parent == 0:  # the parent of the process under test: it forks that, then waits to be killed
        try:
            if os.fork() == 0:
                die_with_parent(signal.SIGKILL)
                os.write(ready_w, f"{os.getpid()}\n".encode())
            os.close(ready_w)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        with os.fdopen(ready_r) as ready:
            child = int(ready.readline())
        alive = not _gone(child)
    finally:
        os.kill(parent, signal.SIGKILL)
        os.waitpid(parent, 0)
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert alive and _gone(child), "the process outlived its parent"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
