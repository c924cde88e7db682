"""Context parallelism's pieces that need no process: the load-balanced sharding, the block
kernels and the log-sum-exp merge, each against torch's own attention or a hand count."""

import functools

import pytest
import torch
import torch.nn.functional as F

from trainer3d.parallel.context import kernels
from trainer3d.data.cp_sharding import (chunks_of, local_positions, shard_positions, shard_sequence,
                                                 unshard_sequence)


def test_cp2_positions_by_hand():
    # 8 tokens in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunks_of(4, 1) == (1, 6)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_partition_the_sequence(cp):
    seq = 24 if cp == 3 else 32
    x = torch.arange(seq)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    for r, s in enumerate(shards):
        assert s.tolist() == shard_positions(seq, cp, r).tolist()
        assert local_positions(seq // cp, cp, r, torch.device("cpu")).tolist() == s.tolist()
    assert torch.equal(unshard_sequence(shards), x)


def test_indivisible_sequence_refused():
    with pytest.raises(ValueError, match="train.seq_len=30 is not a multiple of 2 \\* parallel.cp = 8"):
        shard_positions(30, 4, 0)


def _qkv(heads=4, kv_heads=2, s=16, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, s, d, generator=g, dtype=dtype), torch.randn(2, kv_heads, s, d, generator=g, dtype=dtype),
            torch.randn(2, kv_heads, s, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("impl", ["cpu", "math", "math-tiled"])
def test_blocks_merged_equal_causal_attention(impl):
    """Queries in two halves, keys in two halves: the first half's causal block, the second half's
    full block on the first keys merged with its causal block on the second keys, forward and
    backward, equal torch's causal attention (GQA, fp64); the plain-torch kernels whole and
    3 query rows at a time (tiles that do not divide the block)."""
    tile = {"math": kernels.TILE, "math-tiled": 3}.get(impl)
    fwd = kernels.block_forward if impl == "cpu" else functools.partial(kernels.math_forward, tile=tile)
    bwd = kernels.block_backward if impl == "cpu" else functools.partial(kernels.math_backward, tile=tile)
    q, k, v = _qkv()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    h, scale = q.shape[2] // 2, q.shape[-1] ** -0.5
    first, second = slice(0, h), slice(h, None)
    o1, l1 = fwd(q[:, :, first], k[:, :, first], v[:, :, first], True, scale)
    o2, l2 = fwd(q[:, :, second], k[:, :, second], v[:, :, second], True, scale)
    acc_out, acc_lse = o2.clone(), l2.clone()
    o3, l3 = fwd(q[:, :, second], k[:, :, first], v[:, :, first], False, scale)
    kernels.merge_(acc_out, acc_lse, o3, l3)
    out = torch.cat([o1, acc_out], dim=2)
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)
    lse = torch.cat([l1, acc_lse], dim=2)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, causal in ((first, first, True), (second, second, True), (second, first, False)):
        g = bwd(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                causal, scale)
        dq[:, :, rows] += g[0]
        dk[:, :, cols] += g[1]
        dv[:, :, cols] += g[2]
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
