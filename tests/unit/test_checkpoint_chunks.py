"""Pieces of a tensor's full logical form held by TP shards and ZeRO flat ranges (pure maths)."""

import itertools

import pytest
import torch

from trainer3d.checkpoint.chunks import full_shape, pieces
from trainer3d.model.init import TPShard


def _shard_block(full: torch.Tensor, shard, local_rows):
    """The local block a TP rank holds: a slice along shard.dim, zero padding past shard.full."""
    if shard is None:
        return full.clone()
    pad = list(full.shape)
    pad[shard.dim] = local_rows * shard.size - shard.full
    padded = torch.cat([full, torch.zeros(pad)], dim=shard.dim)
    return padded.narrow(shard.dim, shard.rank * local_rows, local_rows)


@pytest.mark.parametrize("shape,dim,tp,dp", [
    ((257, 6), 0, 2, 3), ((257, 6), 0, 4, 4), ((10, 12), 1, 2, 3), ((12,), None, 1, 5), ((7, 5), None, 1, 4),
    ((9, 4), 0, 4, 2),
])
def test_pieces_of_all_ranks_rebuild_the_full_tensor(shape, dim, tp, dp):
    full = torch.randn(shape)
    rebuilt = torch.full(shape, float("nan"))
    for tp_rank in range(tp):
        if dim is None:
            shard, local = None, full.clone()
        else:
            local_len = -(-shape[dim] // tp)
            shard = TPShard(dim=dim, rank=tp_rank, size=tp, full=shape[dim])
            local = _shard_block(full, shard, local_len)
        flat = local.reshape(-1)
        per = -(-flat.numel() // dp)  # ZeRO-1: dp equal ranges of the flat block (last one short)
        for dp_rank in range(dp):
            start, end = min(dp_rank * per, flat.numel()), min((dp_rank + 1) * per, flat.numel())
            for p in pieces(local.shape, shard, start, end):
                assert start <= p.flat_start and p.flat_start + p.numel <= end
                data = flat[p.flat_start:p.flat_start + p.numel].view(p.sizes)
                region = rebuilt[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]
                assert torch.isnan(region).all(), "pieces overlap"
                region.copy_(data)
    assert full_shape(shape, None) == tuple(shape)
    torch.testing.assert_close(rebuilt, full, rtol=0, atol=0)


def test_padding_is_never_a_piece():
    shard = TPShard(dim=0, rank=3, size=4, full=9)  # 9 rows over 4 ranks of 3: rank 3 holds only padding
    assert pieces((3, 4), shard) == []
    shard = TPShard(dim=0, rank=2, size=4, full=9)  # rows 6..8 of 9 real
    (p,) = pieces((3, 4), shard)
    assert p.offsets == (6, 0) and p.sizes == (3, 4)


def test_flat_range_splits_into_at_most_three_rectangles():
    for start, end in itertools.combinations(range(0, 31, 3), 2):
        got = pieces((5, 6), None, start, end)
        assert 1 <= len(got) <= 3 and sum(p.numel for p in got) == end - start
