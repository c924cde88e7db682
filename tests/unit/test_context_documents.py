"""Document masking under context parallelism, without ranks (trainer3d/parallel/context/documents.py):
which chunk pairs a rank computes for known documents (a hand count), the merge of parts where
a row saw nothing (log-sum-exp -inf) against softmax over the union of the keys."""

import torch

from trainer3d.parallel.context.documents import Pair, causal_pairs, merge_documents_, pairs_to_compute


def test_causal_pairs_of_cp2_by_hand():
    # 4 chunks; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert [(p.q_chunk, p.k_chunk) for p in causal_pairs(2, 0, 0)] == [(0, 0), (3, 0), (3, 3)]
    assert [(p.q_chunk, p.k_chunk) for p in causal_pairs(2, 0, 1)] == [(3, 1), (3, 2)]
    assert [(p.q_chunk, p.k_chunk) for p in causal_pairs(2, 1, 0)] == [(1, 0), (2, 0)]
    assert [(p.q_chunk, p.k_chunk) for p in causal_pairs(2, 1, 1)] == [(1, 1), (2, 1), (2, 2)]


def test_pairs_no_document_spans_are_skipped():
    # 16 tokens, chunks of 4; one document over tokens 2..9, the others inside a chunk:
    # (1,0) t3..t4 and (2,1) t7..t8 are spanned, (2,0) t3..t8 too; every pair into chunk 3 is not
    ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3]], dtype=torch.int32)
    got = {src: [(p.q_chunk, p.k_chunk) for p in pairs_to_compute(ids, 2, 1, src)] for src in (0, 1)}
    assert got == {0: [(1, 0), (2, 0)], 1: [(1, 1), (2, 1), (2, 2)]}
    got = {src: [(p.q_chunk, p.k_chunk) for p in pairs_to_compute(ids, 2, 0, src)] for src in (0, 1)}
    assert got == {0: [(0, 0), (3, 3)], 1: []}
    assert Pair(0, 0, 3, 3).diagonal and not Pair(1, 0, 3, 0).diagonal


def test_merge_of_parts_with_rows_that_saw_nothing():
    """Row 0 sees keys of both parts, row 1 only of the second; a part a row saw nothing of
    comes with out 0 (or NaN, as some kernels leave it) and lse -inf. The merged result is
    softmax attention over the keys each row sees, computed whole."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 6, generator=g, dtype=torch.float64)
    values = torch.randn(6, 3, generator=g, dtype=torch.float64)
    seen = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    masked = scores.masked_fill(~seen, float("-inf"))
    want = torch.softmax(masked, -1) @ values
    acc_out, acc_lse = torch.zeros(2, 3, dtype=torch.float64), torch.full((2,), float("-inf"), dtype=torch.float64)
    for cols in (slice(0, 3), slice(3, 6)):
        part = masked[:, cols]
        lse = torch.logsumexp(part, -1)
        out = torch.softmax(part, -1) @ values[cols]  # NaN where the row saw nothing
        merge_documents_(acc_out, acc_lse, out, lse)
    assert not torch.isnan(acc_out).any()
    torch.testing.assert_close(acc_out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(acc_lse, torch.logsumexp(masked, -1), rtol=0, atol=1e-12)



def test_every_rank_in_one_process_equals_sdpa_on_the_device_of_the_tensors():
    """The path a CUDA rank takes too (tests/gpu/test_document_mask_gpu.py runs it on a GPU):
    nothing in it is CPU-only."""
    from tests.support.cp_documents import cp_blocks_against_sdpa

    worst, computed = cp_blocks_against_sdpa(torch.device("cpu"), torch.float64)
    assert worst < 1e-12 and computed == {0: 4, 1: 5}, (worst, computed)
    worst, _ = cp_blocks_against_sdpa(torch.device("cpu"), torch.float32)
    assert worst < 2e-5, worst
