"""The barrier between the phases of the shared-memory collectives (shm.py): a count in the
shared segment, a kernel sleep while the others are missing, and a check that the peers still
live (shm_barrier.cpp beside this file has the mechanism).

Why not gloo's barrier: it is a message round trip through gloo's worker threads, and the
collectives pass four of them per step (docs/performance.md has the figures). Why not a spin:
a spinning or yielding rank takes the core from the ranks still computing, which slows a host
with more ranks than cores (the test suite's) to a fraction of its pace.

Failure behaves as a gloo collective's: a peer that died (its lock on the segment's file is
gone) raises within ``SLICE_S``, and a peer that hangs raises after the group's timeout
(parallel.timeout_s, trainer3d/parallel/timeouts.py).
"""

import ctypes
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from trainer3d.cpu.build import Build, c_library

LIBRARY = Build(
    "trainer3d_shm_barrier", Path(__file__).with_name("shm_barrier.cpp"), ["-O2"], "shared-memory barrier",
    "the dp collectives use gloo's barrier",
    c_library("t3d_shm_barrier_abi", 1, {
        "t3d_barrier_arrive": ([ctypes.c_void_p, ctypes.c_uint32], None),
        "t3d_barrier_wait": ([ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int64], ctypes.c_int),
        "t3d_byte_lock": ([ctypes.c_int, ctypes.c_int64, ctypes.c_int], ctypes.c_int)}))

SPIN_S = 20e-6
"""How long a rank spins before it sleeps: about a futex wake-up's latency, so a barrier whose
peers arrive within it costs no system call, and a long wait costs at most this much CPU."""
SLICE_S = 0.05
"""How often a sleeping rank looks whether its peers still live, and at its deadline."""


def library() -> Optional[ctypes.CDLL]:
    return LIBRARY.get()


def _group_timeout_s(group) -> float:
    """The timeout ``group``'s gloo backend applies now (the run switches it between start-up
    and steps: parallel/timeouts.py, ``group_timeout_s``, reads it the same way)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


class ShmBarrier:
    """A barrier of the ``world`` ranks of ``group`` that share the segment ``count_address``
    points into (4 aligned bytes, zero at first) and hold locks on bytes [0, world) of ``fd``'s
    file. Every rank must hold its own lock (``take_lock``) before any rank first waits."""

    def __init__(self, group, count_address: int, fd: int):
        self.group, self.fd = group, fd
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)  # the global ranks, for messages
        self._lib = library()
        self._count = count_address
        self._target = 0

    @staticmethod
    def take_lock(fd: int, rank: int) -> None:
        """This rank's liveness lock: held until the process exits or closes ``fd``."""
        rc = library().t3d_byte_lock(fd, rank, 1)
        if rc != 0:
            raise OSError(-rc, f"could not lock byte {rank} of the shared segment")

    def _dead_peer(self) -> Optional[int]:
        for r in range(self.world):
            if r != self.rank and self._lib.t3d_byte_lock(self.fd, r, 0) == 0:
                return r
        return None

    def __call__(self) -> None:
        self._target = (self._target + self.world) & 0xFFFFFFFF
        self._lib.t3d_barrier_arrive(self._count, self._target)
        if self._lib.t3d_barrier_wait(self._count, self._target, int(SPIN_S * 1e6), int(SLICE_S * 1e6)) == 0:
            return
        timeout_s = _group_timeout_s(self.group)
        deadline = time.monotonic() + timeout_s
        while self._lib.t3d_barrier_wait(self._count, self._target, 0, int(SLICE_S * 1e6)) != 0:
            dead = self._dead_peer()
            # a peer that passed this barrier and then exited is no failure: look once more
            if dead is not None and self._lib.t3d_barrier_wait(self._count, self._target, 0, 0) != 0:
                raise RuntimeError(f"rank {self.ranks[self.rank]}: rank {self.ranks[dead]} of this host exited during "
                                   f"a shared-memory collective (its lock on the segment is gone)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.ranks[self.rank]}: timed out after {timeout_s:.0f} s (the group's "
                                   f"timeout, parallel.timeout_s) at a shared-memory barrier: one of ranks "
                                   f"{self.ranks} of this host never arrived")
