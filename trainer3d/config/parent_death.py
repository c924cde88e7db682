"""A process that dies with its parent: prctl(2) ``PR_SET_PDEATHSIG``, Linux only, through libc
by ctypes.

Two kinds of process ask it: a local job's ranks, of submitit's controller
(trainer3d/rank/owner.py), and ``--calibrate``'s probe ranks, of the forkserver they are forked
from (trainer3d/plan/probe.py). The planner may not import the rank's package (the table in
tests/unit/test_imports.py); of the floors both may import (``observe``, ``parallel``,
``config``) this is the one below every other, and the one that imports no torch at its top: the
submitting process imports owner.py (trainer3d/launch/local.py) and stays without torch.
"""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option number (linux/prctl.h)."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for ``sig`` when this process's parent dies (and send it now if it
    already has: the parent may die between fork and this call). Where prctl is refused (not
    Linux) nothing is asked: the caller's other bounds end the process. prctl is looked up
    among the symbols this process has loaded (libc's), without ``ctypes.util.find_library``,
    which runs ``ldconfig -p`` in a subprocess."""
    parent = os.getppid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)
