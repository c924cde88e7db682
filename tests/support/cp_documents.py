"""Document-masked context-parallel attention on any device, every cp rank simulated in one
process: each rank's two chunks of queries meet every rank's key/value block through
trainer3d/parallel/context/documents.py's ``forward_block`` / ``backward_block`` (the pairs no
document spans skipped), and the result is held to SDPA on the whole sequence with a boolean
"same document and not later" mask. Used by tests/unit (CPU) and tests/gpu (CUDA): the code
path is the same on both devices, only the tensors' device differs."""

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from trainer3d.data.cp_sharding import shard_sequence
from trainer3d.parallel.context import documents

CP, SEQ = 2, 16
STARTS = ([0, 6], [0, 3, 10])
"""Two sequences of 16 tokens: documents at 0 and 6; at 0, 3 and 10 (the pairs each rank
computes are counted by hand in tests/multirank/test_context_documents.py: 4 and 5)."""


@dataclass
class _Rank:
    size: int
    rank: int
    blocks_computed: int = 0


def _ids(device: torch.device) -> torch.Tensor:
    ids = torch.zeros(len(STARTS), SEQ, dtype=torch.int32)
    for b, starts in enumerate(STARTS):
        for s in starts[1:]:
            ids[b, s:] += 1
    return ids.to(device)


def cp_blocks_against_sdpa(device: torch.device, dtype: torch.dtype) -> Tuple[float, Dict[int, int]]:
    """(the worst absolute difference of out, dq, dk, dv to SDPA's in ``dtype`` computed in
    fp64, the forward pairs each rank computed)."""
    g = torch.Generator().manual_seed(0)
    b, h, d = len(STARTS), 4, 8
    q, k, v, dout = (torch.randn(b, h, SEQ, d, generator=g, dtype=torch.float64).to(device) for _ in range(4))
    ids = _ids(device)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool,
                                                                             device=device).tril()
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed)
    ref.backward(dout)
    wide, scale = torch.float32 if dtype != torch.float64 else dtype, d ** -0.5
    shard = [[shard_sequence(t.to(dtype), CP, r, dim=2) for t in (q, k, v, dout)] for r in range(CP)]
    ranks = [_Rank(CP, r) for r in range(CP)]
    outs, lses = [], []
    for r, cp in enumerate(ranks):
        acc_out = torch.zeros(b, h, SEQ // CP, d, dtype=wide, device=device)
        acc_lse = torch.full((b, h, SEQ // CP), float("-inf"), dtype=wide, device=device)
        for src in range(CP):
            documents.forward_block(shard[r][0], (shard[src][1], shard[src][2]), src, cp, scale, ids, acc_out, acc_lse)
        outs.append(acc_out.to(dtype))
        lses.append(acc_lse)
    counts = {r: cp.blocks_computed for r, cp in enumerate(ranks)}
    dq = [torch.zeros(b, h, SEQ // CP, d, dtype=wide, device=device) for _ in range(CP)]
    dkv = [[torch.zeros(b, h, SEQ // CP, d, dtype=wide, device=device) for _ in range(2)] for _ in range(CP)]
    for r, cp in enumerate(ranks):
        for src in range(CP):
            documents.backward_block(shard[r][3], shard[r][0], (shard[src][1], shard[src][2]), outs[r], lses[r],
                                     src, cp, scale, ids, dq[r], dkv[src])
    worst = 0.0
    for r in range(CP):
        for got, want in ((outs[r], ref.detach()), (dq[r], qr.grad), (dkv[r][0], kr.grad), (dkv[r][1], vr.grad)):
            worst = max(worst, (got.double() - shard_sequence(want, CP, r, dim=2)).abs().max().item())
    return worst, counts
