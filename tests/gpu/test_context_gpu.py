"""Context parallelism's ring attention on CUDA runs torch's fused kernels for its blocks
(trainer3d/parallel/context/kernels.py ``block_kernel``, fused.py), and equals full causal SDPA.

cp ranks on one GPU: every rank's shard and every block of the ring through the ring's own
per-block steps (attention.py ``_forward_block`` / ``_backward_block``, what each rank runs
between hops), the key/value gradients summed where their blocks live, as the ring does. Marked
``gpu``; skips without CUDA."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer3d.parallel.context.attention import CPGroup, _backward_block, _forward_block
from trainer3d.parallel.context.kernels import acc_dtype, kernel_for
from tests.unit.test_context_sharding import unshard_sequence
from trainer3d.data.cp_sharding import shard_sequence

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "runs where one is)")]


def _ring_on_one_device(q, k, v, dout, cp):
    """(out, dq, dk, dv) of the ring over ``cp`` simulated ranks; full-sequence tensors in and out."""
    shard = lambda t, r: shard_sequence(t, cp, r, dim=2)  # noqa: E731
    qs, douts = [shard(q, r) for r in range(cp)], [shard(dout, r) for r in range(cp)]
    blocks = [torch.stack([shard(k, r), shard(v, r)]) for r in range(cp)]
    scale, wide = q.shape[-1] ** -0.5, acc_dtype(q.dtype)
    outs, dqs = [], []
    dkv = [torch.zeros(blocks[0].shape, dtype=wide, device=q.device) for _ in range(cp)]
    for rank in range(cp):
        group = CPGroup(group=None, size=cp, rank=rank, mode="all_gather")
        b, h, s, d = qs[rank].shape
        # (seq, batch, heads, d) memory as ContextAttentionFunction lays its output out: with batch 2
        # the rows of the output the backward kernels read are batch*heads*d apart
        acc_out = torch.empty((s, b, h, d), dtype=wide, device=q.device).permute(1, 2, 0, 3)
        acc_lse = torch.empty((b, h, s), dtype=wide, device=q.device)
        order = [(rank - step) % cp for step in range(cp)]  # its own block first, as the ring does
        for src in order:
            _forward_block(qs[rank], blocks[src], src, group, scale, acc_out, acc_lse)
        out = acc_out.to(q.dtype)
        dq = torch.zeros(qs[rank].shape, dtype=wide, device=q.device)
        for src in order:
            _backward_block(douts[rank], qs[rank], blocks[src], out, acc_lse, src, group, scale, dq, dkv[src])
        outs.append(out)
        dqs.append(dq.to(q.dtype))
    dk = unshard_sequence([g[0] for g in dkv], dim=2)
    dv = unshard_sequence([g[1] for g in dkv], dim=2)
    return unshard_sequence(outs, dim=2), unshard_sequence(dqs, dim=2), dk, dv


def _torch_own(q, k, v, dout):
    """torch's SDPA on the whole sequence in the inputs' dtype (its fused kernel) and its gradients."""
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), qr.grad, kr.grad, vr.grad


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "cuda_flash"), (torch.float32, "cuda_efficient")])
@pytest.mark.parametrize("cp", [2, 4])
def test_cuda_ring_attention_equals_full_sdpa(dtype, kernel, cp):
    """Output and q/k/v gradients no further from the fp64 result than torch's own attention in
    the same dtype over the whole sequence (twice its error, the ring's merges rounding too)."""
    torch.manual_seed(0)
    b, heads, kv_heads, seq, d = 2, 8, 2, 1024, 64
    q = torch.randn(b, heads, seq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, kv_heads, seq, d, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn(b, heads, seq, d, device="cuda", dtype=dtype)
    assert kernel_for(q) == kernel
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    want.backward(dout.double())
    exact = (want.detach(), qr.grad, kr.grad, vr.grad)
    own = _torch_own(q, k, v, dout)
    got = _ring_on_one_device(q, k, v, dout, cp)
    for name, g, o, w in zip(("out", "dq", "dk", "dv"), got, own, exact):
        ring_err, torch_err = (g.double() - w).abs().max().item(), (o.double() - w).abs().max().item()
        assert ring_err <= 2 * torch_err + 1e-6, (name, ring_err, torch_err)
