"""Grouped-query attention's kernel (trainer3d/model/transformer.py ``kv_expanded``): on CUDA in
fp32, SDPA's grouped mode has only the math composite (seq x seq scores), so K and V are repeated
to every head for the memory-efficient kernel; the estimate counts what that saves
(trainer3d/memory/activations.py). The rule, the repeated computation against torch's own grouped
SDPA and a hand-written softmax attention, and the saved bytes against saved_tensors_hooks."""

import math

import pytest
import torch
import torch.nn.functional as F

from trainer3d.memory.activations import FP32, Sizes, _attention
from trainer3d.memory.meter import SavedActivationMeter
from trainer3d.model.transformer import causal_sdpa, kv_expanded, repeat_kv


@pytest.mark.parametrize("device, dtype, heads, kv_heads, expected", [
    ("cuda", torch.float32, 32, 8, True),    # flash refuses fp32; grouped SDPA would be the math composite
    ("cuda", torch.float32, 32, 32, False),  # no grouping: the memory-efficient kernel takes it as it is
    ("cuda", torch.bfloat16, 32, 8, False),  # flash takes grouped K/V in bf16 and fp16
    ("cuda", torch.float16, 32, 8, False),
    ("cpu", torch.float32, 32, 8, False),    # torch's CPU flash kernel takes grouped K/V
    ("cpu", torch.bfloat16, 32, 8, False),
])
def test_which_calls_repeat_kv(device, dtype, heads, kv_heads, expected):
    assert kv_expanded(device, dtype, heads, kv_heads) is expected


def _reference(q, k, v):
    """Softmax attention by hand, query head i on kv head i // group (Ainslie et al. 2023)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_repeated_kv_equals_grouped_sdpa_and_a_hand_reference():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 16, 12, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 16, 12, dtype=torch.float64, requires_grad=True)
    want = _reference(q, k, v)
    grads_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for expand in (True, False):
        got = causal_sdpa(q, k, v, expand_kv=expand)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads_want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(repeat_kv(k, 8), k.repeat_interleave(4, dim=1), rtol=0, atol=0)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(causal_sdpa(q, k, v, expand_kv=True), grouped, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("expand", [False, True])
def test_saved_bytes_of_attention_equal_the_estimate(expand):
    """What autograd keeps across SDPA with K/V grouped or repeated (the CPU flash kernel saves what
    CUDA's fused kernels save: its inputs, output and log-sum-exp) against the estimate's terms."""
    b, heads, kv_heads, s, d = 2, 8, 2, 64, 16
    # the layout the model hands SDPA: (seq, batch, heads, head_dim) memory seen as (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(s, b, n, d, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    meter = SavedActivationMeter()
    with meter:
        out = causal_sdpa(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), expand_kv=expand)
        measured = meter.live_bytes
    out.sum().backward()
    z = Sizes(b=b, s=s, h=heads * d, heads=heads, kv_heads=kv_heads, head_dim=d, ffn=64, vocab=64, t=1,
              sp=False, p=4, cuda=expand)
    assert z.expand_kv is expand
    terms = _attention(z)
    by_hand = 4 * b * s * d * (heads + 2 * (heads if expand else kv_heads)) + 4 * b * s * heads * d + FP32 * b * s * heads
    assert terms["q_k_v"] + terms["attention"] == by_hand
    # the inputs, the output and the log-sum-exp; the kernel's few scalars (rng state) aside
    assert 0 <= measured - by_hand <= 64, (measured, by_hand)


def test_the_efficient_kernels_log_sum_exp_is_counted_padded_to_32_rows():
    """CUDA's memory-efficient kernel (fp32) keeps ceil(s / 32) * 32 log-sum-exp rows per sequence
    (kAlignLSE); the flash kernels keep s."""
    common = dict(b=3, s=40, h=64, heads=4, kv_heads=4, head_dim=16, ffn=64, vocab=64, t=1, sp=False)
    assert Sizes(**common, p=4, cuda=True).lse_rows == 3 * 64
    assert Sizes(**common, p=2, cuda=True).lse_rows == Sizes(**common, p=4, cuda=False).lse_rows == 3 * 40


def test_context_parallel_attention_is_counted_as_it_saves_grouped_and_unpadded():
    """The cp attention (parallel/context/attention.py) saves its shard's K/V as they are and its
    merged log-sum-exp, one row per query, whatever kernel ran its blocks."""
    z = Sizes(b=1, s=40, h=128, heads=8, kv_heads=2, head_dim=16, ffn=64, vocab=64, t=1, sp=False, p=4,
              cuda=True, cp=2)
    assert not z.expand_kv and z.lse_rows == 40
