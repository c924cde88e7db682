"""fp32 grouped-query attention on CUDA runs a fused kernel, never SDPA's math composite
(trainer3d/model/transformer.py ``kv_expanded``). Marked ``gpu``; skips without CUDA."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer3d.model.transformer import CausalAttention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "runs where one is)")]


def test_fp32_grouped_attention_runs_the_memory_efficient_kernel():
    """With only the memory-efficient kernel allowed, the model's attention runs (grouped fp32 SDPA
    has no fused kernel: torch would say 'No available kernel') and matches the math composite."""
    torch.manual_seed(0)
    q = torch.randn(2, 32, 1024, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 8, 1024, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 8, 1024, 64, device="cuda", requires_grad=True)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = CausalAttention()(q, k, v)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-4)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
