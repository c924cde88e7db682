"""The flat-tensor collectives, behind one small shim, and the ones ZeRO needs.

torch 2.13 renamed the flat-tensor collectives (``reduce_scatter_tensor`` ->
``reduce_scatter_single``, ``all_gather_into_tensor`` -> ``all_gather_single``) and the old
names warn as deprecated; older torch (the package admits >= 2.6) has only the old names.
``all_gather_single`` and ``reduce_scatter_single`` are whichever this torch has (tensor
parallelism's sequence collectives use them too). The ZeRO wrappers below are asynchronous:
callers keep the work handle and wait for it later.

All three run in place on the flat buffers (output is a slice of input, or the reverse):
gloo and NCCL both accept that (checked on gloo at dp 2 and 4; NCCL documents in-place
reduce-scatter/all-gather when the chunk is the rank's own slice), so no bucket-sized copy
is allocated by us.

The ZeRO wrappers take either a process group or, for CPU ranks of one host, the group's
shared-memory collectives (parallel/host_shm.py): the reductions run when their handle is
waited for (a step's in its ``finish``), the gather at once (every reader of the parameters
then finds them gathered, whatever waits it does).
"""

import torch
import torch.distributed as dist

from trainer3d.parallel.host_shm import HostCollectives

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_avg(tensor: torch.Tensor, group) -> dist.Work:
    """Average ``tensor`` over ``group`` in place."""
    if isinstance(group, HostCollectives):
        return group.later(group.all_reduce_avg, tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> None:
    """Sum ``tensor`` over ``group`` (None: the default group) in place, blocking."""
    if isinstance(group, HostCollectives):
        group.all_reduce_sum(tensor)
    else:
        dist.all_reduce(tensor, group=group)


def reduce_scatter_avg(output: torch.Tensor, input: torch.Tensor, group) -> dist.Work:
    """Average ``input`` over ``group``; this rank's equal slice lands in ``output``."""
    if isinstance(group, HostCollectives):
        return group.later(group.reduce_scatter_avg, output, input)
    return reduce_scatter_single(output, input, op=dist.ReduceOp.AVG, group=group, async_op=True)


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> dist.Work:
    """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``."""
    if isinstance(group, HostCollectives):
        group.all_gather(output, input)
        return group.later(lambda: None)
    return all_gather_single(output, input, group=group, async_op=True)


def backend_of(group) -> str:
    return str(dist.get_backend(group))
