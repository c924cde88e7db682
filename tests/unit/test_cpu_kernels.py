"""The fused CPU kernels of trainer3d/cpu/kernels.cpp, the CPU implementation of the model's
operators (model/functional.py; registered by trainer3d/cpu/ops.py) for fp32 CPU tensors: held to a float64 evaluation of the same formulas (an independent reference),
to the Functions' own torch composition (the rotation bit for bit), to themselves on any
number of threads, on strided input, at the limits of exp, and shown to run at all (no torch
operator does the arithmetic) and to give way to the composition where they are off or
cannot be built."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.tolerance import assert_close_to_scale
from trainer3d.cpu import kernels as cpu_kernels
from trainer3d.cpu import shm_barrier
from trainer3d.cpu.build import Build, c_library
from trainer3d.model.functional import apply_rotary, rms_norm, swiglu_linear
from trainer3d.model.transformer import rotary_cos_sin

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the kernels could not be built here")


class _Ops(TorchDispatchMode):
    """The aten operators a block of code dispatches."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]


def _run(fn, leaves, extra, grad, kernels: bool, dtype=torch.float32):
    """fn's value and its leaves' gradients under ``grad``, computed in ``dtype`` (float64: the
    composition, an independent evaluation of the same formulas)."""
    mine = [t.detach().to(dtype).requires_grad_(True) for t in leaves]
    extra = [e.to(dtype) if isinstance(e, torch.Tensor) else e for e in extra]
    with cpu_kernels.enabled(kernels):
        y = fn(*mine, *extra)
        y.backward(grad.to(dtype))
    return [y.detach()] + [t.grad for t in mine]


def _reference_rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, None, :] + torch.cat([-x2, x1], dim=-1) * sin[:, None, None, :]


def _reference_swiglu(a, b, w):
    return F.linear(a * torch.sigmoid(a) * b, w)


CASES = {
    # name: (Function, float64 reference, leaf shapes, extra arguments); rows > 64 and elements
    # > 16384 so that threads split the work
    "rms_norm": (rms_norm, _reference_rms_norm, [(40, 4, 96), (96,)], (1e-5,)),
    "rotary": (apply_rotary, _reference_rotary, [(160, 4, 3, 32)],
               rotary_cos_sin(160, 32, 10000.0, torch.device("cpu"))),
    "swiglu": (swiglu_linear, _reference_swiglu, [(40, 4, 120), (40, 4, 120), (24, 120)], ()),
}


def _case(name):
    """The case's Function, reference, leaves, extra arguments and an upstream gradient."""
    fn, ref, shapes, extra = CASES[name]
    leaves = _leaves(*shapes)
    with torch.no_grad():
        grad = torch.randn(fn(*leaves, *extra).shape, generator=torch.Generator().manual_seed(1))
    return fn, ref, leaves, extra, grad


@pytest.mark.parametrize("name", CASES)
def test_kernels_match_float64(name):
    """Values and gradients within fp32 rounding of float64 (and as close as the composition)."""
    fn, ref, leaves, extra, grad = _case(name)
    fused = _run(fn, leaves, extra, grad, kernels=True)
    composed = _run(fn, leaves, extra, grad, kernels=False)
    exact = _run(ref, leaves, extra, grad, kernels=False, dtype=torch.float64)
    for got, plain, want in zip(fused, composed, exact):
        err, plain_err = (got.double() - want).abs().max().item(), (plain.double() - want).abs().max().item()
        assert err <= 4 * plain_err + 1e-6 * want.abs().max().item(), (name, err, plain_err)
        assert_close_to_scale(got.double(), want)


def test_rotation_is_bit_for_bit_the_composition():
    fn, _, leaves, extra, grad = _case("rotary")
    for got, want in zip(_run(fn, leaves, extra, grad, True), _run(fn, leaves, extra, grad, False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", CASES)
def test_any_number_of_threads_gives_the_same_bits(name):
    """The kernels' bits do not depend on how threads split the rows. SwiGLU's case applies an
    identity weight, so the matmuls around the kernel (BLAS, whose blocking does change with the
    thread count on some CPUs) pass the kernel's values through exactly, and the weight's
    gradient, a BLAS reduction, is left out."""
    fn, _, leaves, extra, grad = _case(name)
    if name == "swiglu":
        leaves = [*leaves[:2], torch.eye(leaves[0].shape[-1]).requires_grad_(True)]
        with torch.no_grad():
            grad = torch.randn(fn(*leaves).shape, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_run(fn, leaves, extra, grad, kernels=True)[:3 if name == "swiglu" else None])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("name", CASES)
def test_the_kernels_do_the_arithmetic(name):
    """With the kernels on no torch operator computes the elementwise part (only allocations and
    the matmuls dispatch); off, the composition's operators run."""
    fn, _, shapes, extra = CASES[name]
    leaves = _leaves(*shapes)
    arithmetic = {"mul", "mul_", "add", "add_", "sub_", "rsqrt", "silu", "silu_backward", "mean", "pow", "sum"}
    for kernels in (True, False):
        with cpu_kernels.enabled(kernels), _Ops() as ops:
            y = fn(*leaves, *extra)
            y.backward(torch.full_like(y, 0.5))
        used = arithmetic & set(ops.names)
        assert (not used) if kernels else used, (kernels, sorted(set(ops.names)))


def test_rotary_reads_the_gradient_in_attentions_memory_order():
    """The gradient reaching RoPE is attention's, (batch, heads, seq) in memory: read in place."""
    fn, _, shapes, extra = CASES["rotary"]
    (x,) = _leaves(*shapes)
    permuted = x.detach().permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
    assert not permuted.is_contiguous()
    out = cpu_kernels.rotary(permuted, *extra, 1)
    assert out.is_contiguous() and torch.equal(out, cpu_kernels.rotary(x.detach().contiguous(), *extra, 1))


def test_silu_at_the_limits_of_exp():
    """silu and its gradient where exp under- or overflows, at infinities and NaN, as torch's."""
    a = torch.tensor([-1e4, -104.0, -89.0, -88.5, -87.4, -87.3, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.4, 88.8, 104.0,
                      1e4, float("inf"), float("-inf"), float("nan")])
    b = torch.linspace(-2, 2, a.numel())
    g = torch.linspace(1, -1, a.numel())
    prod = cpu_kernels.swiglu_forward(a, b)
    want = F.silu(a) * b
    torch.testing.assert_close(prod, want, rtol=2e-7, atol=0, equal_nan=True)
    prod2, ga, gb = cpu_kernels.swiglu_backward(g, a, b, True, True)
    torch.testing.assert_close(prod2, prod, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gb, g * F.silu(a), rtol=2e-7, atol=0, equal_nan=True)
    torch.testing.assert_close(ga, torch.ops.aten.silu_backward(g * b, a), rtol=2e-7, atol=0, equal_nan=True)


def test_rms_norm_propagates_a_non_finite_input():
    """A NaN or infinity in a row leaves that row non-finite (the non-finite watch must see it)."""
    x = torch.randn(3, 64)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    y, rstd = cpu_kernels.rms_norm_forward(x, torch.ones(64), 1e-5)
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).all()


def test_off_and_unbuildable_run_the_composition(tmp_path, monkeypatch, caplog):
    """TRAINER3D_CPU_KERNELS=0 and a machine without a compiler both run torch's operators: the
    same bits as the composition, with one logged line where the build is impossible. The
    variable is read at import (a fresh process); the build without a compiler is this process's
    own first try of a Build of the kernels' source (the module's LIBRARY tried once per process)."""
    code = ("import torch\n"
            "from trainer3d.cpu import kernels as cpu_kernels\n"
            "from trainer3d.model.functional import rms_norm\n"
            "x = torch.randn(8, 64); w = torch.randn(64)\n"
            "y = rms_norm(x, w, 1e-5)\n"
            "with cpu_kernels.enabled(False): z = rms_norm(x, w, 1e-5)\n"
            "print('built', cpu_kernels._lib is not None, 'equal', torch.equal(y, z))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRAINER3D_CPU_KERNELS": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "equal True" in proc.stdout, proc.stdout

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lib = cpu_kernels.LIBRARY
    monkeypatch.setattr(cpu_kernels, "LIBRARY", Build(lib.name, lib.source, lib.flags, lib.what, lib.fallback,
                                                      lib._load, lib.unfit))
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels._lib)
    monkeypatch.setattr(cpu_kernels, "_on", True)
    x, w = torch.randn(8, 64), torch.randn(64)
    with caplog.at_level("WARNING", logger="trainer3d.cpu.build"):
        y = rms_norm(x, w, 1e-5)
    with cpu_kernels.enabled(False):
        z = rms_norm(x, w, 1e-5)
    assert cpu_kernels._lib is None and torch.equal(y, z)
    said = [r.getMessage() for r in caplog.records if r.name == "trainer3d.cpu.build"]
    assert len(said) == 1 and "no C++ compiler" in said[0], said


def test_a_build_lives_in_torchs_extension_directory_and_follows_its_flags(tmp_path, monkeypatch):
    """trainer3d/cpu/build.py builds through torch.utils.cpp_extension: under
    TORCH_EXTENSIONS_DIR, by name; a changed flag makes a new build, not a stale load."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = shm_barrier.LIBRARY.source

    def build(flags):  # the path of the library built
        return Build("t3d_test_build", source, flags, "test build", "none", str).get() or pytest.fail("no build")

    first = build(["-O2"])
    assert first.startswith(str(tmp_path)) and first.endswith(".so"), first
    second = build(["-O2", "-DT3D_OTHER"])
    assert second != first
    assert c_library("t3d_shm_barrier_abi", 1, {})(second)._name == second  # an extern "C" library, ABI checked
