"""Document masking under context parallelism (``data.document_mask`` with ``parallel.cp`` > 1).

Every rank holds the segments of the whole window (trainer3d/data/segments.py: one document
id per token, non-decreasing along the window), so the document of any key a block brings is
known without sending ids with the keys and values. Positions restart at each document in the
whole window (trainer3d/model/documents.py ``Segments.positions``) and each rank takes its
chunks' share of them, so RoPE sees what it sees in one process.

A rank's queries are two chunks (of 2·cp, trainer3d/data/cp_sharding.py) and so is every
key/value block, so a block meets a rank's queries in up to four chunk pairs (query chunk a,
key chunk c); the causal mask keeps those with c <= a. Under document masking a query sees a
key when both are of one document, so a pair c < a has anything to compute only when some
sequence has one document from key chunk c's last token to query chunk a's first (the ids
do not decrease: the last key is the key chunk's latest document, the first query the
query chunk's earliest). A pair that none has is skipped, with no compute in forward or
backward; a diagonal pair (c == a) always has each token's own key. With documents shorter
than a chunk, most pairs between chunks are skipped, as FlexAttention skips the blocks of its
block mask that no document spans (torchtitan's document mask, torchtitan/models/attention.py).

A computed pair masks by the ids, in the plain-torch kernel (kernels.py, ``math_forward`` /
``math_backward``, a tile of query rows at a time: the mask is never more than a tile by a
chunk). A query row that sees no key of a pair (its document starts after the key chunk)
gets out 0 and lse -inf from it, and ``merge_documents_`` gives such a part no weight (a
plain log-sum-exp merge would compute exp(-inf - -inf), NaN, where nothing has been seen).

CUDA: torch's fused kernels (fused.py) take only the causal flag, no per-element mask, and
FlexAttention's backward cannot start from the merged output and log-sum-exp the ring hands
each block; so on CUDA too every computed pair runs the plain-torch kernel (torch ops on the
ranks' device, a tile of rows at a time): exact, and slower than the fused kernels the
unmasked ring uses (tests/gpu/test_document_mask_gpu.py holds it to SDPA on a GPU).
"""

from dataclasses import dataclass
from typing import List, Tuple

import torch

from trainer3d.data.cp_sharding import chunks_of
from trainer3d.parallel.context.kernels import math_backward, math_forward

@dataclass(frozen=True)
class Pair:
    """Query chunk ``q_half`` (0 or 1 of this rank's two) against key chunk ``k_half`` of a block."""

    q_half: int
    k_half: int
    q_chunk: int
    k_chunk: int

    @property
    def diagonal(self) -> bool:
        return self.q_chunk == self.k_chunk


def causal_pairs(cp: int, me: int, src: int) -> List[Pair]:
    """The chunk pairs of rank ``src``'s block that rank ``me``'s queries may see causally."""
    return [Pair(qh, kh, qc, kc) for qh, qc in enumerate(chunks_of(cp, me))
            for kh, kc in enumerate(chunks_of(cp, src)) if kc <= qc]


def spanned(ids: torch.Tensor, pair: Pair, chunk: int) -> bool:
    """Whether any sequence of ``ids`` (batch, seq) has a document reaching from the pair's key
    chunk into its query chunk (always, on the diagonal)."""
    if pair.diagonal:
        return True
    last_key = ids[:, (pair.k_chunk + 1) * chunk - 1]
    first_query = ids[:, pair.q_chunk * chunk]
    return bool((last_key == first_query).any())


def pairs_to_compute(ids: torch.Tensor, cp: int, me: int, src: int) -> List[Pair]:
    chunk = ids.shape[-1] // (2 * cp)
    return [pair for pair in causal_pairs(cp, me, src) if spanned(ids, pair, chunk)]


def _slices(pair: Pair, chunk: int) -> Tuple[slice, slice, torch.Tensor, torch.Tensor]:
    rows = slice(pair.q_half * chunk, (pair.q_half + 1) * chunk)
    cols = slice(pair.k_half * chunk, (pair.k_half + 1) * chunk)
    return rows, cols, slice(pair.q_chunk * chunk, (pair.q_chunk + 1) * chunk), \
        slice(pair.k_chunk * chunk, (pair.k_chunk + 1) * chunk)


def merge_documents_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """kernels.merge_ for parts where a row may have seen nothing (lse -inf, in the accumulator
    or the part): such a part adds nothing, and a row nothing has reached stays (0, -inf)."""
    lse = lse.to(acc_lse.dtype)
    new_lse = torch.logaddexp(acc_lse, lse)
    safe = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    part = out.to(acc_out.dtype) * torch.exp(lse - safe).unsqueeze(-1)
    acc_out.add_(part.masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0))
    acc_lse.copy_(new_lse)


def forward_block(q, block, src: int, cp, scale: float, ids: torch.Tensor, acc_out, acc_lse) -> None:
    """Merge block ``src``'s document-masked attention into the accumulators (zeros and -inf to
    start), pair by pair; skipped pairs cost nothing."""
    chunk = q.shape[2] // 2
    for pair in pairs_to_compute(ids, cp.size, cp.rank, src):
        rows, cols, q_pos, k_pos = _slices(pair, chunk)
        out, lse = math_forward(q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], pair.diagonal, scale,
                                ids=(ids[:, q_pos], ids[:, k_pos]))
        merge_documents_(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)
        cp.blocks_computed += 1


def backward_block(dout, q, block, out, lse, src: int, cp, scale: float, ids: torch.Tensor, dq, dkv) -> None:
    """Block ``src``'s part of the gradients, the same pairs as ``forward_block``."""
    chunk = q.shape[2] // 2
    for pair in pairs_to_compute(ids, cp.size, cp.rank, src):
        rows, cols, q_pos, k_pos = _slices(pair, chunk)
        g = math_backward(dout[:, :, rows], q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols],
                          out[:, :, rows], lse[:, :, rows], pair.diagonal, scale, ids=(ids[:, q_pos], ids[:, k_pos]))
        dq[:, :, rows] += g[0]
        dkv[0][:, :, cols] += g[1]
        dkv[1][:, :, cols] += g[2]
        cp.blocks_computed += 1
