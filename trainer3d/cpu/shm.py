"""ZeRO's gradient all-reduce and parameter all-gather among the CPU ranks of one host, through
shared memory instead of gloo's TCP loopback.

gloo moves every byte through the kernel's socket buffers, on a thread of its own that
competes with the ranks' compute for the same cores, and a rank waits for it after its
backward (docs/performance.md has the figures). Through one
shared segment it is four memory passes: each rank writes its tensor into its slot, reduces
its 1/world of the elements over all slots in rank order, and reads everyone's reduced part
back. Every element is summed by one rank in one order, so all ranks hold the same bits.
Ordering between the phases is a barrier on a count in the segment, where a waiting rank
sleeps in the kernel (shm_barrier.py: a dead peer raises within 50 ms, a hung one after the
group's timeout, parallel.timeout_s); where that barrier's small library cannot be built on
every rank, gloo's own barrier on the group.

Set up collectively per group: rank 0 creates the segment in /dev/shm (O_EXCL, mode 0600,
space reserved with posix_fallocate, so a full /dev/shm is an error here and not a SIGBUS
later) and writes a random token into it; every rank maps it by name and checks the token;
only if all ranks succeeded is it used (ranks on different hosts, or a private /dev/shm, fall
back to gloo together), and rank 0 unlinks the name as soon as the ranks have answered, or the
start failed (a peer died, a collective raised), so nothing is left behind once the set-up is
over, whatever happens to the job. A rank 0 killed (SIGKILL, the OOM killer) between making the
segment and unlinking it leaves its name behind, which no code of that process can remove: the
next set-up on the host removes such leftovers (``sweep_leftovers``: this user's segments whose
maker is gone and which are older than any set-up, trainer3d/cpu/shm_leftovers.py). Larger tensors go through in chunks of the
segment's size.
``TRAINER3D_SHM_COLLECTIVES=0`` keeps gloo.
"""

import ctypes
import logging
import mmap
import os
import secrets
import weakref
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from trainer3d.cpu import shm_barrier
from trainer3d.cpu.shm_barrier import ShmBarrier
from trainer3d.cpu.shm_leftovers import PREFIX, sweep_leftovers

log = logging.getLogger(__name__)

HEADER = 64
"""Bytes before the slots: the token (16 bytes), the barrier's count (4 bytes at COUNT), and
64-byte alignment for the slots. Each rank's liveness lock covers byte ``rank`` of the file
(a record lock: it does not touch the bytes)."""
COUNT = 32
MAX_CHUNK_BYTES = 8 * 2 ** 20
"""Bytes per slot at most: (world + 1) slots, so 2 ranks map 24 MiB, 8 ranks 72 MiB."""


class Deferred:
    """The handle of a collective that runs when it is waited for (the callers' contract is an
    asynchronous one: launch, then wait). Every rank waits for its handles in the same program
    order, so the collectives' barriers meet; the time lands where the wait is, as a gloo
    collective's exposed part would: a step's bucket reductions in its ``metrics.comm()``."""

    def __init__(self, run: Callable[[], None]):
        self._run: Optional[Callable[[], None]] = run

    def wait(self, timeout=None) -> bool:
        if self._run is not None:
            run, self._run = self._run, None
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


class ShmCollectives:
    """ZeRO's collectives (parallel/comm.py's ``Collectives``) on flat CPU tensors among the
    ranks of ``group``, all on this host, through a shared segment of ``world + 1`` slots of
    ``chunk_bytes``: the averages run when their handle is waited for (``Deferred``), the
    gather and the sum at once."""

    def __init__(self, group, segment: mmap.mmap, fd: int, chunk_bytes: int, own_barrier: bool):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.segment, self.chunk_bytes = segment, chunk_bytes
        weakref.finalize(self, os.close, fd)  # closing it drops this rank's liveness lock
        count = ctypes.addressof(ctypes.c_uint32.from_buffer(segment, COUNT))
        self._barrier = ShmBarrier(group, count, fd) if own_barrier else self._gloo_barrier
        self._bytes = torch.frombuffer(segment, dtype=torch.uint8, offset=HEADER,
                                       count=(self.world + 1) * chunk_bytes)

    def _slots(self, dtype: torch.dtype) -> List[torch.Tensor]:
        """The world input slots and the result slot, as ``dtype`` elements."""
        return list(self._bytes.view(self.world + 1, self.chunk_bytes).view(dtype).unbind(0))

    def _gloo_barrier(self) -> None:
        dist.barrier(group=self.group)

    def _average(self, inputs: List[torch.Tensor], lo: int, hi: int, out: torch.Tensor) -> None:
        """out = the mean of every rank's slot over [lo, hi), summed in rank order."""
        torch.add(inputs[0][lo:hi], inputs[1][lo:hi], out=out)
        for r in range(2, self.world):
            out.add_(inputs[r][lo:hi])
        out.div_(self.world)

    # ------------------------------------------------ the Collectives protocol (parallel/comm.py)

    reduce_scatter_is_fast = True
    """Each rank reads back only its shard, where the all-reduce reads back everything."""

    def all_reduce_avg(self, tensor: torch.Tensor) -> Deferred:
        return Deferred(lambda: self._all_reduce_avg(tensor))

    def reduce_scatter_avg(self, output: torch.Tensor, input: torch.Tensor) -> Deferred:
        return Deferred(lambda: self._reduce_scatter_avg(output, input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Deferred:
        """At once: every reader of the parameters then finds them gathered, whatever it waits for."""
        self._all_gather(output, input)
        return Deferred(lambda: None)

    # ------------------------------------------------ the collectives themselves, run at once

    def _all_reduce_avg(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` (flat, contiguous, floating) over the group in place."""
        slots = self._slots(tensor.dtype)
        *inputs, result = slots
        step = result.numel()
        for off in range(0, tensor.numel(), step):
            part = tensor[off:off + step]
            m = part.numel()
            inputs[self.rank][:m].copy_(part)
            self._barrier()  # every slot written (and every rank done reading the last result)
            share = -(-m // self.world)
            lo, hi = min(m, self.rank * share), min(m, (self.rank + 1) * share)
            if lo < hi:
                self._average(inputs, lo, hi, result[lo:hi])
            self._barrier()  # every share reduced
            part.copy_(result[:m])

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (a few elements: a norm, a count) over the group in place, at once:
        each rank adds every rank's slot in rank order, so all hold the same bits."""
        flat = tensor.view(-1)
        *inputs, _ = self._slots(tensor.dtype)
        if flat.numel() > inputs[0].numel():
            raise ValueError(f"{flat.numel()} elements do not fit the segment's {inputs[0].numel()}")
        m = flat.numel()
        inputs[self.rank][:m].copy_(flat)
        self._barrier()  # every slot written
        flat.copy_(inputs[0][:m])
        for r in range(1, self.world):
            flat.add_(inputs[r][:m])
        self._barrier()  # every slot read before the next collective writes them

    def _reduce_scatter_avg(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Average ``input`` (world equal shards) over the group; this rank's shard of the
        average lands in ``output`` (which may be that shard of ``input``). Each rank writes
        its whole input once and reads back only its shard: ZeRO-1's reduction, which needs
        no more (the rest of ``input`` keeps this rank's own sum)."""
        *inputs, _ = self._slots(input.dtype)
        shard = input.numel() // self.world
        step = max(1, inputs[0].numel() // self.world)
        for off in range(0, shard, step):
            m = min(step, shard - off)
            mine = inputs[self.rank]
            for d in range(self.world):  # destination d's piece, at d * m in this rank's slot
                mine[d * m:(d + 1) * m].copy_(input[d * shard + off:d * shard + off + m])
            self._barrier()  # every slot written
            lo, hi = self.rank * m, (self.rank + 1) * m
            self._average(inputs, lo, hi, output[off:off + m])
            self._barrier()  # every share read before the next chunk overwrites the slots

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's ``input`` (equal sizes) into ``output`` in rank order; ``input`` may be
        this rank's slice of ``output``."""
        *slots, _ = self._slots(input.dtype)
        size, step = input.numel(), slots[0].numel()
        for off in range(0, size, step):
            m = min(step, size - off)
            slots[self.rank][:m].copy_(input[off:off + m])
            self._barrier()  # every slot written
            for r in range(self.world):
                if r != self.rank:
                    output[r * size + off:r * size + off + m].copy_(slots[r][:m])
            self._barrier()  # every slot read before the next chunk overwrites it
            if output.data_ptr() + self.rank * size * output.element_size() != input.data_ptr():
                output[self.rank * size + off:self.rank * size + off + m].copy_(input[off:off + m])


def _enabled() -> bool:
    return os.environ.get("TRAINER3D_SHM_COLLECTIVES", "1").strip().lower() not in ("0", "false", "no", "off")


def _create(size: int):
    """Rank 0's side: (name, token) of a new segment of ``size`` bytes, or None with why."""
    for name in sweep_leftovers():
        log.warning("removed /dev/shm/%s, left by a trainer3d process killed while its shared-memory "
                    "collectives started", name)
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    token = secrets.token_bytes(16)
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return name, token


def _open(name: str, token: bytes, size: int) -> Tuple[mmap.mmap, int]:
    """The mapped segment and its file, left open (the liveness lock lives on it)."""
    fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"/dev/shm/{name} has {os.fstat(fd).st_size} bytes, not {size}")
        segment = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    if segment[:16] != token:
        segment.close()
        os.close(fd)
        raise OSError(f"/dev/shm/{name} is not the segment rank 0 made (another host's /dev/shm)")
    return segment, fd


def _attach(group, offer, size: int) -> Tuple[Optional[mmap.mmap], int, List[object]]:
    """This rank's mapping of rank 0's ``offer`` (name, token) or why not, and every rank's
    (why not, has the barrier's library) gathered: the verdicts all ranks decide on alike."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    segment, fd, why = None, -1, offer if isinstance(offer, str) else None
    own_barrier = False
    if why is None:
        name, token = offer
        try:
            segment, fd = _open(name, token, size)
        except (OSError, ValueError) as e:
            why = f"rank {rank}: {e}"
        else:
            try:  # the liveness lock is taken before the verdicts: every peer holds it before any barrier
                own_barrier = shm_barrier.library() is not None
                if own_barrier:
                    ShmBarrier.take_lock(fd, rank)
            except OSError as e:
                log.warning("rank %d: %s; the dp collectives use gloo's barrier", rank, e)
                own_barrier = False
    verdicts: List[object] = [None] * world
    try:
        dist.all_gather_object(verdicts, (why, own_barrier), group=group)
    except BaseException:
        if segment is not None:
            segment.close()
            os.close(fd)
        raise
    return segment, fd, verdicts


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def shm_collectives(group, numel: int, element_size: int = 4) -> Optional[ShmCollectives]:
    """Collective over ``group``: shared-memory collectives for tensors of up to ``numel``
    elements in one chunk, or None (every rank alike) where gloo stays: another backend, one
    rank, switched off, ranks on different hosts, no room in /dev/shm."""
    if not _enabled() or group is None or dist.get_backend(group) != "gloo" or dist.get_world_size(group) < 2:
        return None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = min(MAX_CHUNK_BYTES, max(64, -(-numel * element_size // 64) * 64))
    size = HEADER + (world + 1) * chunk
    offer: List[object] = [None]
    if rank == 0:
        try:
            offer = [_create(size)]
        except (OSError, AttributeError) as e:  # AttributeError: no posix_fallocate (macOS)
            offer = [f"rank 0 could not make a {size >> 20} MiB segment in /dev/shm ({e})"]
    made = offer[0][0] if isinstance(offer[0], tuple) else None
    try:
        dist.broadcast_object_list(offer, src=dist.get_global_rank(group, 0), group=group)
        segment, fd, verdicts = _attach(group, offer[0], size)
    finally:
        # Every rank has mapped the segment or given up, or a peer died on the way and the
        # collective raised: the name goes on every path rank 0 lives through, so a start that
        # fails leaves nothing in /dev/shm (a mapping outlives its name, as an open file does).
        if made is not None:
            _unlink(made)
    own_barrier = all(has for _, has in verdicts)
    failed = [why for why, _ in verdicts if why is not None]
    if failed:
        if segment is not None:
            segment.close()
            os.close(fd)
        if rank == 0:
            log.info("dp collectives stay on gloo: %s", failed[0])
        return None
    if rank == 0:
        log.info("dp all-reduce and all-gather through shared memory among %d ranks of this host "
                 "(%.1f MiB segment, %s barrier)", world, size / 2 ** 20, "its own" if own_barrier else "gloo's")
    return ShmCollectives(group, segment, fd, chunk, own_barrier)
