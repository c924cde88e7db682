"""Context parallelism's pieces that need no process: the load-balanced sharding, the block
kernels and the log-sum-exp merge, each against torch's own attention or a hand count."""

import functools

import pytest
import torch
import torch.nn.functional as F

from trainer3d.parallel.context import kernels
from trainer3d.data.cp_sharding import chunks_of, local_positions, shard_positions, shard_sequence


def test_cp2_positions_by_hand():
    # 8 tokens in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunks_of(4, 1) == (1, 6)


def unshard_sequence(shards, dim: int = -1) -> torch.Tensor:
    """The full sequence from every cp rank's shard (in cp rank order): the inverse of
    ``shard_sequence``, written from the load-balanced layout (rank r holds chunks r and 2cp-1-r)."""
    cp = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [halves[c][0] for c in range(cp)] + [halves[c][1] for c in reversed(range(cp))]
    return torch.cat(ordered, dim=dim)


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


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("device, dtype, head_dim, capability, expected", [
    ("cpu", FP32, 64, None, "cpu_flash"),
    ("cpu", BF16, 64, None, "cpu_flash"),
    ("cuda", BF16, 128, (9, 0), "cuda_flash"),      # H100
    ("cuda", FP16, 64, (8, 0), "cuda_flash"),       # A100
    ("cuda", FP32, 128, (9, 0), "cuda_efficient"),  # flash refuses fp32
    ("cuda", BF16, 512, (9, 0), "cuda_efficient"),  # flash stops at 256
    ("cuda", FP16, 64, (7, 0), "cuda_efficient"),   # V100: no flash
    ("cuda", BF16, 64, (7, 5), "math"),             # bf16 before sm80: no fused kernel
    ("cuda", BF16, 12, (9, 0), "math"),             # 16-bit head width not a multiple of 8
    ("cuda", FP32, 12, (9, 0), "cuda_efficient"),   # fp32: a multiple of 4 suffices
    ("mps", FP32, 64, None, "math"),
])
def test_the_block_kernel_for_each_device_and_dtype(device, dtype, head_dim, capability, expected):
    assert kernels.block_kernel(device, dtype, head_dim, capability) == expected


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_the_fused_cuda_calls_take_their_arguments(kernel, dtype):
    """torch's CUDA ops on the meta device (their registered shapes, no GPU): the calls the ring
    makes are accepted; grouped K/V keep their heads in the gradients; the efficient kernel's
    log-sum-exp comes back unpadded (40 queries: its own rows are ceil(40 / 32) * 32 = 64)."""
    from trainer3d.parallel.context import fused

    q = torch.empty(2, 8, 40, 64, device="meta", dtype=dtype)
    k, v = (torch.empty(2, 2, 40, 64, device="meta", dtype=dtype) for _ in range(2))
    out, lse = getattr(fused, f"{kernel}_forward")(q, k, v, True, 0.125)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (2, 8, 40), FP32)
    dq, dk, dv = getattr(fused, f"{kernel}_backward")(torch.empty_like(out), q, k, v, out, lse, True, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def _as_the_efficient_kernel_reads(out: torch.Tensor) -> torch.Tensor:
    """``out`` (b, heads, s, d) read as torch's efficient backward kernel reads it: the op passes on
    the batch and head strides of its (b, s, heads, d) view and steps rows by heads * d
    (aten/src/ATen/native/transformers/cuda/attention_backward.cu: p.o_strideB, p.o_strideH;
    mem_eff_attention/kernel_backward.h: ``o_strideM()`` = head_dim_value * num_heads, used by
    computeDelta for rowsum(dO * O))."""
    t = out.transpose(1, 2)
    b, s, h, d = t.shape
    return torch.as_strided(t, (b, s, h, d), (t.stride(0), h * d, t.stride(2), 1),
                            t.storage_offset()).transpose(1, 2)


@pytest.mark.parametrize("rows", [slice(None), slice(4, None)])
def test_the_efficient_backward_gets_the_output_in_the_layout_its_kernel_reads(monkeypatch, rows):
    """The ring's merged output lives as (seq, batch, heads, d) (attention.py, so the caller's
    (seq, batch, heads*d) is a view); with batch 2 its rows are batch*heads*d apart, and the
    efficient kernel, which steps rows by heads*d, would read the other sequence's rows. What
    the op is handed must read back, the kernel's way, as the output itself (a recorded call:
    the CUDA op does not run on CPU)."""
    from trainer3d.parallel.context import fused

    b, h, s, d = 2, 4, 8, 16
    out = torch.randn(s, b, h, d, dtype=FP32).permute(1, 2, 0, 3)[:, :, rows]
    q = torch.randn(out.shape, dtype=FP32)
    k, v = (torch.randn(b, 2, out.shape[2], d, dtype=FP32) for _ in range(2))
    handed = []

    def recorded(dout, q_, k_, v_, bias, out_, lse, *rest, **kw):
        handed.append(out_)
        return torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_), None

    monkeypatch.setattr(fused, "_EFFICIENT_BACKWARD", recorded)
    lse = torch.zeros(out.shape[:3], dtype=FP32)
    fused.efficient_backward(torch.randn(out.shape), q, k, v, out, lse, False, d ** -0.5)
    assert torch.equal(handed[0], out)
    assert torch.equal(_as_the_efficient_kernel_reads(handed[0]), out)
