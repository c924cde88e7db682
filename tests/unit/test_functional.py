"""model/functional.py's autograd Functions against the plain torch composition they replace
(values and gradients, fp32 and bf16), and what they save, counted by ``saved_tensors_hooks``.

Here the Functions run their own torch composition (``cpu_kernels.enabled(False)``, as on a GPU);
their fused CPU kernels are held to it in tests/unit/test_cpu_kernels.py. What they save is
counted both ways."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer3d.config.schema import ModelConfig
from trainer3d.memory.activations import Sizes, layer_terms
from trainer3d.memory.meter import SavedActivationMeter
from trainer3d.cpu import kernels as cpu_kernels  # the package's import registers the CPU kernels
from trainer3d.model.functional import COMPOSITIONS, apply_rotary, rms_norm, swiglu_linear
from trainer3d.model.transformer import Block, rotary_cos_sin

DTYPES = [torch.float32, torch.bfloat16]


def _plain_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _plain_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def _plain_swiglu_linear(a, b, weight):
    return F.linear(F.silu(a) * b, weight)


def _leaves(*shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in shapes]


def _compare(fn, ref, tensors, extra=(), dtype=torch.float32):
    """Values and gradients of ``fn`` (its torch composition) and ``ref`` on copies of the same
    leaves, under the same upstream gradient."""
    ours = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    theirs = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    with cpu_kernels.enabled(False):
        y = fn(*ours, *extra)
    y_ref = ref(*theirs, *extra)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # forward: the same operators
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    with cpu_kernels.enabled(False):
        y.backward(grad)
    y_ref.backward(grad)
    # bf16: the composition rounds its intermediate gradients to 8 bits where the Functions keep fp32
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for mine, want in zip(ours, theirs):
        assert mine.grad.dtype == want.grad.dtype
        torch.testing.assert_close(mine.grad.float(), want.grad.float(), **tol)


def _saved_bytes(fn, *args) -> int:
    meter = SavedActivationMeter([a for a in args if isinstance(a, torch.nn.Parameter)])
    with meter:
        out = fn(*args)
    out.float().sum().backward()
    assert meter.live_bytes == 0
    return meter.peak_bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_composition(dtype):
    x, w = _leaves((5, 3, 32), (32,), dtype=dtype)
    _compare(rms_norm, _plain_rms_norm, [x, w], (1e-5,), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_composition(dtype):
    (x,) = _leaves((6, 2, 4, 16), dtype=dtype)
    cos, sin = rotary_cos_sin(6, 16, 10000.0, torch.device("cpu"))
    _compare(apply_rotary, _plain_rotary, [x], (cos, sin), dtype)


def test_rotary_tables_are_kept_per_shape_and_handed_out_as_copies():
    """rotary_cos_sin keeps its tables per (seq_len, head_dim, theta, scaling, device) and returns
    a copy of them (model/transformer.py): every key gets the tables computed afresh, bit for bit,
    on its first call and its later ones; what a caller writes into its copy reaches no later
    call, and no copy requires a gradient. Under a dispatch mode nothing is kept: both calls run
    the whole computation (plan/kernels.py counts a block's operators under one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer3d.config.schema import RopeScalingConfig
    from trainer3d.model.transformer import _tables

    from trainer3d.model.transformer import _cached_tables

    cpu = torch.device("cpu")
    _cached_tables.cache_clear()
    llama3 = dict(type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8)
    cases = [(12, 16, 10000.0, None), (20, 16, 10000.0, None), (12, 16, 500.0, None), (12, 8, 10000.0, None),
             (12, 16, 10000.0, RopeScalingConfig(factor=8.0, **llama3)),
             (12, 16, 10000.0, RopeScalingConfig(factor=2.0, **llama3)), (12, 16, 10000.0, RopeScalingConfig())]
    for _ in range(2):
        for seq, head_dim, theta, scaling in cases:
            want = _tables(seq, head_dim, theta, cpu, scaling, None)
            got = rotary_cos_sin(seq, head_dim, theta, cpu, scaling)
            assert all(torch.equal(g, w) and not g.requires_grad for g, w in zip(got, want)), (seq, theta, scaling)
            for table in got:
                table.mul_(-2.0)
    # kept, computed once per key: six keys (the scaling of type "none" is keyed as no scaling), 14 calls
    assert _cached_tables.cache_info()[:2] == (8, 6), _cached_tables.cache_info()

    class Count(TorchDispatchMode):
        calls = 0

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # as plan/kernels.py's: no torch._dynamo import for a counting mode

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for _ in range(2):
        Count.calls = 0
        with Count():
            rotary_cos_sin(28, 16, 10000.0, cpu)
        counts.append(Count.calls)
    assert counts[0] == counts[1] > 2, counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_linear_matches_the_composition(dtype):
    a, b, w = _leaves((6, 2, 24), (6, 2, 24), (16, 24), dtype=dtype)
    _compare(swiglu_linear, _plain_swiglu_linear, [a, b, w], (), dtype)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "composition"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_functions_save_only_what_backward_needs(dtype, kernels):
    """Each storage counted once: the norm keeps x and 1/rms, RoPE its tables, SwiGLU a and b
    (the same with the CPU kernels, which run for fp32)."""
    with cpu_kernels.enabled(kernels):
        _saved_bytes_of_each(dtype)


def _saved_bytes_of_each(dtype):
    n, h, f, p = 12, 32, 48, torch.finfo(dtype).bits // 8
    x = torch.randn(n, 1, h, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(h, dtype=dtype))
    assert _saved_bytes(rms_norm, x, w, 1e-5) == p * n * h + 4 * n

    q = torch.randn(n, 1, 2, 16, dtype=dtype, requires_grad=True)
    cos, sin = rotary_cos_sin(n, 16, 10000.0, torch.device("cpu"))
    assert _saved_bytes(apply_rotary, q, cos, sin) == 2 * 4 * n * 16

    a, b = (torch.randn(n, 1, f, dtype=dtype, requires_grad=True) for _ in range(2))
    w2 = torch.nn.Parameter(torch.randn(h, f, dtype=dtype))
    assert _saved_bytes(swiglu_linear, a, b, w2) == 2 * p * n * f


def _block_sbh(dim, heads, kv_heads, ffn, s=32, b=4):
    """Saved bytes of one bf16 block (flash kernel) per s b h, measured over its forward, and as
    the formula (trainer3d/memory/activations.py) predicts them."""
    cfg = ModelConfig(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=8,
                      max_seq_len=s)
    torch.manual_seed(0)
    block = Block(cfg).to(torch.bfloat16)
    x = torch.randn(s, b, dim, dtype=torch.bfloat16, requires_grad=True)
    meter = SavedActivationMeter(block.parameters())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), meter:
        block(x)  # the peak: every saved tensor lives until backward, which would only release them
    z = Sizes(b=b, s=s, h=dim, heads=heads, kv_heads=kv_heads, head_dim=dim // heads, ffn=ffn, vocab=8, t=1,
              sp=False, p=2)
    return meter.peak_bytes / (s * b * dim), sum(layer_terms(z).values()) / (s * b * dim)


@pytest.mark.parametrize("shape,heads,kv_heads,ffn_ratio", [("7B", 8, 8, 2.6875), ("70B", 8, 1, 3.5)])
def test_a_block_saves_at_most_28_sbh(shape, heads, kv_heads, ffn_ratio):
    """Llama-2's shapes scaled down with head_dim 128 kept: at b = 4 and h = 1024 the small
    terms (log-sum-exp 4a/h, RoPE tables 8 head_dim/(b h), 1/rms 8/h, per sbh) are those of the
    real models (h = 4096 or 8192) at b = 1, so the measured sbh is theirs."""
    dim = 1024
    measured, predicted = _block_sbh(dim, heads, kv_heads, int(ffn_ratio * dim))
    print(f"{shape}: {measured:.2f} sbh per layer (bf16, flash)")
    assert measured == predicted
    assert measured <= 28.0


def test_the_operators_are_the_composition_elsewhere_and_the_kernels_on_cpu():
    """The model's operators (torch.ops.trainer3d) run their composition on any device without a
    kernel of its own (here the meta device, as a dry run or another accelerator meets it), and
    trainer3d/cpu/, once imported, gives CPU its own implementation."""
    for name in COMPOSITIONS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"trainer3d::{name}", "CPU"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"trainer3d::{name}", "CUDA"), name
    x, w = torch.empty(5, 3, 8, device="meta", dtype=torch.bfloat16), torch.empty(8, device="meta")
    y, rstd = torch.ops.trainer3d.rms_norm_forward(x, w, 1e-5)
    assert (y.device.type, y.dtype, tuple(rstd.shape), rstd.dtype) == ("meta", torch.float32, (5, 3, 1), torch.float32)
    a = torch.empty(4, 2, 16, device="meta")
    assert torch.ops.trainer3d.swiglu_forward(a, a).shape == a.shape
    prod, ga, gb = torch.ops.trainer3d.swiglu_backward(a, a, a, False, True)
    assert prod is None and ga.shape == gb.shape == a.shape and ga.device.type == "meta"
