"""Wire context parallelism into the model: each block's attention core becomes the cp one.

The model (trainer3d/model/transformer.py) computes rotary positions and attention through
its ``Attention.core``; ``apply_context_parallel`` swaps that core for ``ContextAttention``,
whose positions are this cp rank's two chunks (trainer3d/data/cp_sharding.py) and whose attention reads the
other ranks' keys and values (attention.py). Everything else in a block works token by
token and needs nothing. It composes with tensor parallelism (the core sees this tp rank's
heads; under sequence parallelism the tp region has gathered the cp rank's local tokens
first), with pipelining (a stage's blocks only) and with recomputation (the forward's
exchange runs again in the same order on every cp rank).
"""

from typing import List

import torch
from torch import nn

from trainer3d.parallel.context.attention import CPGroup, context_attention
from trainer3d.data.cp_sharding import local_positions
from trainer3d.parallel.topology import ParallelDims


class ContextAttention(nn.Module):
    """The causal attention of this cp rank's tokens over the whole sequence."""

    def __init__(self, cp: CPGroup):
        super().__init__()
        self.cp = cp
        # The exchange is point-to-point and collective calls on a process group, which dynamo
        # does not trace: under train.compile the rest of the block compiles around it. Wrapped
        # here, when cp > 1 builds the core, not as a decorator: torch.compiler.disable imports
        # torch._dynamo (about 1.5 s of every process's start), which a layout without cp never uses.
        self._attend = torch.compiler.disable(context_attention)

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        return local_positions(seq, self.cp.size, self.cp.rank, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attend(q, k, v, self.cp)

    def extra_repr(self) -> str:
        return f"cp={self.cp.size}, rank={self.cp.rank}, mode={self.cp.mode}"


def apply_context_parallel(chunks: List[nn.Module], dims: ParallelDims, mode: str = "ring") -> int:
    """Give every transformer block of ``chunks`` the cp attention (cp > 1); returns how many."""
    if dims.cp == 1:
        return 0
    cp = CPGroup(dims.cp_group, dims.cp, dims.cp_rank, mode)
    count = 0
    for chunk in chunks:
        for block in chunk.layers.values():
            block.attention.core = ContextAttention(cp)
            count += 1
    return count
