"""The flat-tensor collectives behind one small shim, and the ``Collectives`` ZeRO and clipping
talk to.

torch 2.13 renamed the flat-tensor collectives (``reduce_scatter_tensor`` ->
``reduce_scatter_single``, ``all_gather_into_tensor`` -> ``all_gather_single``) and the old
names warn as deprecated; torch releases before the rename have only the old names.
``all_gather_single`` and ``reduce_scatter_single`` are whichever this torch has (tensor
parallelism's sequence collectives use them too).

``Collectives`` is what ZeRO's buckets and the gradient norm ask of a group, built once per
group by ``collectives``: a process group's own (``GroupCollectives``) or, among the CPU
ranks of one host, shared memory (trainer3d/cpu/shm.py). The averages and the gather are
asynchronous: callers keep the handle and wait for it later. They run in place on the flat
buffers (output is a slice of input, or the reverse): gloo and NCCL both accept that (checked
on gloo at dp 2 and 4; NCCL documents in-place reduce-scatter/all-gather when the chunk is the
rank's own slice), so no bucket-sized copy is allocated by us.
"""

from typing import Optional, Protocol

import torch
import torch.distributed as dist

from trainer3d.cpu.shm import shm_collectives

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives(Protocol):
    """The collectives of one group, as ZeRO and clipping use them."""

    reduce_scatter_is_fast: bool
    """Whether a reduce-scatter costs less than an all-reduce here (ZeRO-1's ``auto`` reduction)."""

    def all_reduce_avg(self, tensor: torch.Tensor) -> dist.Work:
        """Average ``tensor`` over the group in place."""

    def reduce_scatter_avg(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        """Average ``input`` over the group; this rank's equal slice lands in ``output``."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group in place, blocking."""


class GroupCollectives:
    """``Collectives`` through a process group's backend (None: the default group)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group

    @property
    def reduce_scatter_is_fast(self) -> bool:
        """NCCL reduce-scatters faster than it all-reduces, gloo the reverse (docs/performance.md)."""
        return backend_of(self.group) == "nccl"

    def all_reduce_avg(self, tensor: torch.Tensor) -> dist.Work:
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def reduce_scatter_avg(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        return reduce_scatter_single(output, input, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        return all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


def collectives(group: Optional[dist.ProcessGroup], device: torch.device, numel: int) -> Collectives:
    """The collectives of ``group`` (None: the default group) for tensors of up to ``numel``
    elements at once: through one host's shared memory where every rank is a CPU rank of this
    host (trainer3d/cpu/shm.py decides, every rank alike), else the group's backend."""
    if device.type == "cpu":
        shm = shm_collectives(group if group is not None else dist.group.WORLD, numel)
        if shm is not None:
            return shm
    return GroupCollectives(group)


def backend_of(group) -> str:
    return str(dist.get_backend(group))
