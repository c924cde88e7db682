"""Wire context parallelism into the model: each block's attention core becomes the cp one.

The model (trainer3d/model/transformer.py) computes rotary positions and attention through
its ``Attention.core``; ``apply_context_parallel`` swaps that core for ``ContextAttention``,
whose positions are this cp rank's two chunks (trainer3d/data/cp_sharding.py) and whose attention reads the
other ranks' keys and values (attention.py). Everything else in a block works token by
token and needs nothing. It composes with tensor parallelism (the core sees this tp rank's
heads; under sequence parallelism the tp region has gathered the cp rank's local tokens
first), with pipelining (a stage's blocks only) and with recomputation (the forward's
exchange runs again in the same order on every cp rank). With document masking
(data.document_mask) the model's ``Segments`` (trainer3d/model/documents.py) give the
positions, restarting at each document of the whole window, and the ids the attention masks
by (documents.py).
"""

from typing import List, Optional

import torch
from torch import nn

from trainer3d.parallel.context.attention import CPGroup, context_attention
from trainer3d.data.cp_sharding import local_positions
from trainer3d.model.documents import Segments, segments_of
from trainer3d.parallel.topology import ParallelDims


class ContextAttention(nn.Module):
    """The causal attention of this cp rank's tokens over the whole sequence (within each
    document of it, given the ``segments``)."""

    def __init__(self, cp: CPGroup, segments: Optional[Segments] = None):
        super().__init__()
        self.cp, self.segments = cp, segments
        # The exchange is point-to-point and collective calls on a process group, which dynamo
        # does not trace: under train.compile the rest of the block compiles around it. Wrapped
        # here, when cp > 1 builds the core, not as a decorator: torch.compiler.disable imports
        # torch._dynamo (about 1.5 s of every process's start), which a layout without cp never uses.
        # The segments' caches are Python state as well, read inside the eager part (model/documents.py
        # DocumentAttention): dynamo would guard on them and trace again for every micro-batch.
        self._attend = torch.compiler.disable(self._context_attention)
        self._document_positions = torch.compiler.disable(self._shard_of_document_positions)

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """This rank's positions, (seq,); with segments (batch, seq), each document's from 0."""
        if self.segments is not None:
            return self._document_positions(seq, device)
        return local_positions(seq, self.cp.size, self.cp.rank, device)

    def _shard_of_document_positions(self, seq: int, device: torch.device) -> torch.Tensor:
        whole = self.segments.positions(device)
        return whole[:, local_positions(seq, self.cp.size, self.cp.rank, device)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attend(q, k, v)

    def _context_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ids = None if self.segments is None else self.segments.window_ids(q.device)
        return context_attention(q, k, v, self.cp, ids)

    def extra_repr(self) -> str:
        return f"cp={self.cp.size}, rank={self.cp.rank}, mode={self.cp.mode}, documents={self.segments is not None}"


def apply_context_parallel(chunks: List[nn.Module], dims: ParallelDims, mode: str = "ring") -> int:
    """Give every transformer block of ``chunks`` the cp attention (cp > 1), document-masked where
    the chunks carry document segments (model/documents.py ``apply_document_mask``, applied
    first); returns how many."""
    if dims.cp == 1:
        return 0
    cp = CPGroup(dims.cp_group, dims.cp, dims.cp_rank, mode)
    segments = segments_of(chunks)
    count = 0
    for chunk in chunks:
        for block in chunk.layers.values():
            block.attention.core = ContextAttention(cp, segments)
            count += 1
    return count
