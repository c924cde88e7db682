"""Exact causal attention across the cp ranks' shards, as one autograd Function.

Each rank holds its queries, keys and values for two chunks (trainer3d/data/cp_sharding.py); the keys and
values of the other ranks come to it block by block (comm.py: around a ring, or gathered at
once) and each block's partial attention is merged into the result by its log-sum-exp
(kernels.py). Which part of a block a rank's queries see follows from the chunk layout:
rank i holds chunks (i, 2cp−1−i), block j holds chunks (j, 2cp−1−j), so

    j == i: the rank's own keys: an ordinary causal mask (its positions are ascending);
    j <  i: every query sees the first half of block j (chunk j) and none of chunk 2cp−1−j;
    j >  i: only the second half of the queries (chunk 2cp−1−i) sees block j, all of it.

Every block costs the same (half a square), which is why the chunks are laid out so.
With document masking (``ids``: the window's document ids) a block is computed chunk pair by
chunk pair, skipping the pairs no document spans (documents.py).

Memory: the Function saves q, k, v, the output and the log-sum-exp of this rank's tokens
(``ctx.save_for_backward``, so ``saved_tensors_hooks`` sees them, as for torch's own
attention); the other ranks' blocks are not kept but exchanged again in backward, so the
saved bytes scale as 1/cp. Gradients: dq stays here, each block's dk and dv travel back to
the rank that owns the block and are summed there.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from trainer3d.parallel.context import comm, documents
from trainer3d.parallel.context.kernels import acc_dtype, block_backward, block_forward, merge_

MODES = ("ring", "all_gather")


@dataclass
class CPGroup:
    """The cp group as attention needs it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    mode: str = "ring"
    """ring | all_gather (parallel.cp_attention)."""
    blocks_computed: int = 0
    """Chunk pairs the document-masked attention computed, forward and backward (documents.py:
    the ones no document spans are skipped)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"parallel.cp_attention={self.mode!r}: choose one of {', '.join(MODES)}")
        self.ring = comm.Ring(self.group) if self.mode == "ring" else None


def _parts(src: int, me: int, half: int) -> Tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of block ``src`` that rank ``me``'s queries see."""
    every = slice(None)
    if src == me:
        return every, every, True
    if src < me:
        return every, slice(0, half), False
    return slice(half, None), every, False


def _forward_block(q, block, src: int, cp: CPGroup, scale: float, acc_out, acc_lse, ids=None) -> None:
    if ids is not None:
        return documents.forward_block(q, block, src, cp, scale, ids, acc_out, acc_lse)
    rows, cols, causal = _parts(src, cp.rank, q.shape[2] // 2)
    out, lse = block_forward(q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], causal, scale)
    if src == cp.rank:
        acc_out.copy_(out)
        acc_lse.copy_(lse)
    else:
        merge_(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)


def _backward_block(dout, q, block, out, lse, src: int, cp: CPGroup, scale: float, dq, dkv, ids=None) -> None:
    if ids is not None:
        return documents.backward_block(dout, q, block, out, lse, src, cp, scale, ids, dq, dkv)
    rows, cols, causal = _parts(src, cp.rank, q.shape[2] // 2)
    g = block_backward(dout[:, :, rows], q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols],
                       out[:, :, rows], lse[:, :, rows], causal, scale)
    dq[:, :, rows] += g[0]
    dkv[0][:, :, cols] += g[1]
    dkv[1][:, :, cols] += g[2]


def _each_block(own: torch.Tensor, cp: CPGroup, work: Callable[[torch.Tensor, int], None]) -> None:
    """Call ``work(block, src)`` on every cp rank's key/value block, this rank's own first:
    around the ring (the next hop in flight during the current block's work) or gathered."""
    if cp.ring is None:
        blocks = comm.gather_blocks(own, cp.group)
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            work(blocks[src], src)
        return
    block = own
    for step in range(cp.size):
        hop = cp.ring.start(block) if step + 1 < cp.size else None
        work(block, (cp.rank - step) % cp.size)
        if hop is not None:
            comm.wait(hop[1])
            block = hop[0]


class ContextAttentionFunction(torch.autograd.Function):
    """q (batch, heads, seq, d), k and v (batch, kv_heads, seq, d), this rank's shard;
    returns the causal attention of its queries over the whole sequence, q's layout; with
    ``ids`` (batch, whole window) int, within each document only."""

    @staticmethod
    def forward(ctx, q, k, v, ids, cp: CPGroup, scale: float):
        own = torch.stack([k, v])  # one message per hop: (2, batch, kv_heads, seq, d)
        b, h, s, d = q.shape
        # The output in (seq, batch, heads, d) memory, so the caller's (seq, batch, heads*d) is a view.
        wide = acc_dtype(q.dtype)
        acc_out = torch.empty((s, b, h, d), dtype=wide, device=q.device).permute(1, 2, 0, 3)
        acc_lse = torch.empty((b, h, s), dtype=wide, device=q.device)
        if ids is not None:  # documents.py merges every part, rows that see nothing of one included
            acc_out.zero_()
            acc_lse.fill_(float("-inf"))
        _each_block(own, cp, lambda block, src: _forward_block(q, block, src, cp, scale, acc_out, acc_lse, ids))
        out = acc_out if q.dtype == wide else acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse, *(() if ids is None else (ids,)))
        ctx.cp, ctx.scale = cp, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        cp, scale, ids = ctx.cp, ctx.scale, (rest[0] if rest else None)
        wide = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        own = torch.stack([k, v])
        if cp.ring is None:
            dkv_all = torch.zeros((cp.size, *own.shape), dtype=wide, device=q.device)
            _each_block(own, cp, lambda block, src: _backward_block(dout, q, block, out, lse, src, cp, scale,
                                                                    dq, dkv_all[src], ids))
            dkv = comm.scatter_grads(dkv_all, cp.group)
        else:
            dkv = _ring_backward(dout, q, own, out, lse, cp, scale, dq, ids)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _ring_backward(dout, q, own, out, lse, cp: CPGroup, scale: float, dq, ids=None) -> torch.Tensor:
    """Each block's key/value gradient travels with the block, gathering every rank's part;
    one last hop takes it home. Returns this rank's block's (2, ...) gradient, in dq's dtype.
    This rank's part is computed before the part of the ranks the block passed is waited for
    (then added), so a rank does not wait on its neighbour's compute before starting its own."""
    block, grad_hop = own, None
    for step in range(cp.size):
        hop = cp.ring.start(block) if step + 1 < cp.size else None
        dkv = torch.zeros(own.shape, dtype=dq.dtype, device=q.device)
        _backward_block(dout, q, block, out, lse, (cp.rank - step) % cp.size, cp, scale, dq, dkv, ids)
        if grad_hop is not None:  # the gradient of the block held, from the ranks it passed
            comm.wait(grad_hop[1])
            dkv += grad_hop[0]
        grad_hop = cp.ring.start(dkv, comm.GRAD_TAG)
        if hop is not None:
            comm.wait(hop[1])
            block = hop[0]
    comm.wait(grad_hop[1])
    return grad_hop[0]


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup,
                      ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The causal attention of this rank's queries over the whole sequence, q's layout; with
    ``ids`` (batch, whole window) document ids, within each document (CPU ranks: documents.py)."""
    return ContextAttentionFunction.apply(q, k, v, ids, cp, q.shape[-1] ** -0.5)
