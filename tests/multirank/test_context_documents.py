"""Document-masked context-parallel attention (trainer3d/parallel/context/documents.py) on cp gloo
ranks against torch's SDPA on the whole sequence with a boolean mask of "same document and not
later" (fp64, each rank computes the reference itself), for the ring and the all-gather
exchange; and the chunk pairs each rank computes against a hand count for known documents."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.harness import dims_for, run_ranks
from trainer3d.data.cp_sharding import shard_sequence
from trainer3d.parallel.context.attention import CPGroup, context_attention

# cp = 2, 16 tokens: 4 chunks of 4, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
# Sequence 0: documents at 0 and 6; sequence 1: at 0, 3 and 10.
STARTS = ([0, 6], [0, 3, 10])
SEQ, CP = 16, 2


def ids_of(starts, seq):
    ids = torch.zeros(len(starts), seq, dtype=torch.int32)
    for b, doc_starts in enumerate(starts):
        for s in doc_starts[1:]:
            ids[b, s:] += 1
    return ids


# The hand count. Causal chunk pairs (query chunk, key chunk): rank 0 sees (0,0) (3,3) on the
# diagonal and (3,0) (3,1) (3,2); rank 1 (1,1) (2,2) and (1,0) (2,0) (2,1). A pair off the
# diagonal is computed when, in some sequence, one document runs from the key chunk's last
# token (4c+3) to the query chunk's first (4a):
#   (1,0) t3..t4: seq 0 doc 0 -> computed        (2,0) t3..t8: seq 1 doc 1 -> computed
#   (2,1) t7..t8: seq 0 doc 1 -> computed        (3,0) t3..t12: no sequence -> skipped
#   (3,1) t7..t12: seq 0 doc 1 -> computed       (3,2) t11..t12: both -> computed
# Rank 0: 2 diagonal + (3,1), (3,2) = 4; rank 1: 2 diagonal + 3 = 5, per pass.
HAND_COUNT = {0: 4, 1: 5}
# One document per chunk (starts 0, 4, 8, 12): no document spans two chunks, only the diagonals run.
ALIGNED = ([0, 4, 8, 12],)


def _reference(q, k, v, dout, ids):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    seq = ids.shape[-1]
    allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _compare(rank, world, mode, starts, kv_heads):
    dims = dims_for(cp=world)
    ids = ids_of(starts, SEQ)
    g = torch.Generator().manual_seed(0)
    b, h, d = ids.shape[0], 4, 8
    q, k, v, dout = (torch.randn(b, n, SEQ, d, generator=g, dtype=torch.float64) for n in (h, kv_heads, kv_heads, h))
    ref = _reference(q, k, v, dout, ids)

    def mine(t):
        return shard_sequence(t, world, dims.cp_rank, dim=2)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    cp = CPGroup(dims.cp_group, dims.cp, dims.cp_rank, mode)
    out = context_attention(*local, cp, ids)
    forward_count = cp.blocks_computed
    out.backward(mine(dout))
    got = [out.detach(), *(t.grad for t in local)]
    diffs = [(a - mine(r)).abs().max().item() for a, r in zip(got, ref)]
    return dims.cp_rank, diffs, forward_count, cp.blocks_computed - forward_count


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_document_masked_cp_attention_equals_whole_sequence_and_skips_pairs(mode):
    for cp_rank, diffs, forward, backward in run_ranks(_compare, CP, mode, STARTS, 2, timeout=120):
        assert max(diffs) < 1e-12, diffs
        assert (forward, backward) == (HAND_COUNT[cp_rank], HAND_COUNT[cp_rank]), (cp_rank, forward, backward)


def test_documents_within_chunks_compute_only_the_diagonal():
    for cp_rank, diffs, forward, backward in run_ranks(_compare, CP, "ring", ALIGNED, 4, timeout=120):
        assert max(diffs) < 1e-12, diffs
        assert (forward, backward) == (2, 2), (cp_rank, forward, backward)
