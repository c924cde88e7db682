"""Context-parallel attention on cp gloo ranks against torch's causal attention on the whole
sequence: each rank computes the reference itself (same seed, fp64), runs its shard through
the cp attention, and compares its part of the output and of the q/k/v gradients
(grouped-query attention), for the ring and the all-gather exchange; in bf16 and fp16 the cp
result is held to torch's own attention's distance from the fp64 reference in that dtype."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.harness import dims_for, run_ranks
from trainer3d.parallel.context.attention import CPGroup, context_attention
from trainer3d.data.cp_sharding import shard_sequence


def _attend_whole(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _compare(rank, world, mode, kv_heads, dtype):
    dims = dims_for(cp=world)
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 8 * world, 8
    q, k, v, dout = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (h, kv_heads, kv_heads, h))
    ref = _attend_whole(q, k, v, dout)
    whole = _attend_whole(*(t.to(dtype) for t in (q, k, v, dout)))  # torch's attention in ``dtype``

    def mine(t):
        return shard_sequence(t, world, dims.cp_rank, dim=2)

    local = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, CPGroup(dims.cp_group, dims.cp, dims.cp_rank, mode))
    out.backward(mine(dout).to(dtype))
    got = [out.detach(), *(t.grad for t in local)]
    diffs = [(a.double() - mine(r)).abs().max().item() for a, r in zip(got, ref)]
    torch_diffs = [(mine(a).double() - mine(r)).abs().max().item() for a, r in zip(whole, ref)]
    return diffs, torch_diffs


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("world,kv_heads", [(2, 4), (4, 2)])
def test_cp_attention_equals_whole_sequence(mode, world, kv_heads):
    for diffs, _ in run_ranks(_compare, world, mode, kv_heads, torch.float64, timeout=120):
        assert max(diffs) < 1e-12, diffs


@pytest.mark.parametrize("mode,dtype", [("ring", torch.bfloat16), ("all_gather", torch.bfloat16),
                                        ("ring", torch.float16)])
def test_cp_attention_low_precision_as_close_as_torch(mode, dtype):
    for diffs, torch_diffs in run_ranks(_compare, 2, mode, 2, dtype, timeout=120):
        assert all(a <= 2 * b + 1e-3 for a, b in zip(diffs, torch_diffs)), (diffs, torch_diffs)
