"""Data parallelism with ZeRO: gradient reduction over dp and the sharded optimizer.

Stage 0 (``ReplicatedOptimizer``): every dp rank keeps the whole AdamW state; after a
step's backward the gradients are averaged over the dp group.
"""

from typing import List

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.config import Config
from trainer3d.model.init import tp_shard_of
from trainer3d.optim import adamw, param_groups
from trainer3d.parallel.clip import clip_by_global_norm_, sum_of_squares
from trainer3d.topology import ParallelDims


def counted_once_over_tp(param: torch.Tensor, dims: ParallelDims) -> bool:
    """TP shards are distinct on every tp rank; replicated parameters are counted on tp rank 0."""
    return tp_shard_of(param) is not None or dims.tp_rank == 0


class ReplicatedOptimizer:
    """ZeRO stage 0: AdamW replicated over dp, gradients all-reduced (averaged) over dp."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        self.dims = dims
        self.cfg = cfg
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = adamw(param_groups(named, cfg.optim.weight_decay), cfg.optim)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from (fp16 multiplies by the dynamic loss scale)."""
        return loss

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor holding ``param``'s dp-reduced gradient after reduce_gradients()."""
        return param.grad

    def reduce_gradients(self) -> None:
        if self.dims.dp == 1:
            return
        grads = [p.grad for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dims.dp_group)
        flat.div_(self.dims.dp)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        counted = [p.grad for p in self.params if counted_once_over_tp(p, self.dims)] if self.dims.dp_rank == 0 else []
        local_sq = sum_of_squares(counted, self.dims.device)
        return clip_by_global_norm_(local_sq, [p.grad for p in self.params], max_norm)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def build_optimizer(chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
    if cfg.parallel.zero_stage == 0:
        return ReplicatedOptimizer(chunks, cfg, dims)
    raise NotImplementedError(f"parallel.zero_stage={cfg.parallel.zero_stage}")
