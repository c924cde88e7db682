"""The global gradient norm over TP, PP and DP in one all-reduce, and clipping by it.

Each optimizer wrapper knows which gradient elements this rank must count so that every
element of the full model's gradient is counted exactly once over the world (a TP-
replicated norm weight on tp rank 0 only; a gradient replicated over dp on one dp rank or
its owning ZeRO shard; an expert-parallel slice of experts on one rank of its expert-dp group
or its owning shard there: parallel/expert/optimizer.py). The sum of squares is reduced once over the default group; the
clip coefficient stays a device tensor, so there is no host sync in the step.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from trainer3d.model.init import split_over_tp
from trainer3d.parallel import comm
from trainer3d.parallel.topology import ParallelDims


def counted_once_over_tp(param: torch.Tensor, dims: ParallelDims) -> bool:
    """TP shards are distinct on every tp rank; replicated parameters (an ep rank's experts
    among them: whole on every tp rank) are counted on tp rank 0."""
    return split_over_tp(param) or dims.tp_rank == 0


def sum_of_squares(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float32)
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in tensors])
    return torch.stack(norms).pow(2).sum()


def clip_by_global_norm_(local_sq: torch.Tensor, grads: List[torch.Tensor], max_norm: float,
                         world: Optional[comm.Collectives] = None) -> torch.Tensor:
    """Reduce this rank's share of the squared norm over the world, scale ``grads`` in place
    so the global norm is at most ``max_norm`` (0: no clipping); return the global norm.
    ``world``: the world's collectives (parallel/comm.py), else the default group's."""
    total = local_sq.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        (world or comm.GroupCollectives()).all_reduce_sum(total)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
    return norm
