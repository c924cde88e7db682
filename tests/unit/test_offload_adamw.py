"""The host step of ZeRO-Offload (trainer3d/parallel/zero/offload.py: ``HostAdamW``) against
torch's own ``torch.optim.AdamW`` (the non-fused reference implementation): a matrix with
weight decay and a norm weight without, owned in two pieces with padding between them, the
gradients divided by a host divisor (clip coefficient x loss scale), an fp16 overflow skipped;
bf16 parameters come back as the masters' cast.
"""

import os
import platform
import shutil

import pytest
import torch
from torch import nn

from trainer3d.config.schema import OptimConfig
from trainer3d.optim.adamw import segments_of
from trainer3d.parallel.zero.host_kernel import host_kernel, run_table
from trainer3d.parallel.zero.offload import HostAdamW, contiguous_runs

CFG = OptimConfig(lr=1e-2, weight_decay=0.1)


def _layout(dtype):
    """A 6x5 matrix at [0, 30) and a norm of 7 at [32, 39) of a 40-element flat buffer (padding
    at 30-31 and 39), owned as the pieces [0, 32) and [32, 40)."""
    torch.manual_seed(0)
    w, norm = nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(7))
    flat = torch.zeros(40, dtype=dtype)
    flat[0:30], flat[32:39] = w.detach().view(-1), norm.detach()
    grads = torch.zeros(40)
    pieces = [(0, 32), (32, 40)]
    segments = segments_of({w: "layers.0.mlp.w1.weight", norm: "layers.0.ffn_norm.weight"},
                           {w: (0, 30), norm: (32, 39)}, pieces)
    return w, norm, flat, grads, HostAdamW(segments, pieces, flat, grads, CFG)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_step_is_torch_adamw(dtype):
    w, norm, flat, grads, adam = _layout(dtype)
    ref_w, ref_norm = nn.Parameter(adam.master[0:30].clone().view(6, 5)), nn.Parameter(adam.master[32:39].clone())
    ref = torch.optim.AdamW([{"params": [ref_w], "weight_decay": CFG.weight_decay},
                             {"params": [ref_norm], "weight_decay": 0.0}],
                            lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, foreach=False)
    assert contiguous_runs(adam.segments, adam.decay) == [(0, 30, True), (32, 39, False)]
    for step, divisor in enumerate([1.0, 4.0, 0.5]):
        g = torch.randn(40)
        adam.grad.copy_(g)
        adam.step(CFG.lr, torch.tensor([divisor]) if divisor != 1.0 else None, torch.zeros(1))
        adam.params_to_device()
        ref_w.grad, ref_norm.grad = g[0:30].view(6, 5) / divisor, g[32:39] / divisor
        ref.step()
        torch.testing.assert_close(adam.master[0:30].view(6, 5), ref_w.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(adam.master[32:39], ref_norm.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(flat[0:30], ref_w.detach().view(-1).to(dtype)), step
        assert torch.equal(flat[32:39], ref_norm.detach().to(dtype)), step
    assert adam.step_count.item() == 3


def test_an_overflowing_step_changes_nothing():
    w, norm, flat, grads, adam = _layout(torch.float16)
    adam.grad.copy_(torch.randn(40))
    adam.step(CFG.lr, None, torch.zeros(1))
    before = [t.clone() for t in (adam.master, adam.exp_avg, adam.exp_avg_sq)]
    adam.grad.fill_(float("inf"))
    adam.step(CFG.lr, torch.tensor([65536.0]), torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(before, (adam.master, adam.exp_avg, adam.exp_avg_sq)))
    assert adam.step_count.item() == 1


def test_host_state_is_not_the_device_buffers():
    """On a CPU rank "device" and host are both main memory: the host state must still be a
    buffer of its own, written only by the explicit copies."""
    w, norm, flat, grads, adam = _layout(torch.float32)
    held = {t.untyped_storage().data_ptr() for t in adam.host_tensors()}
    assert not held & {flat.untyped_storage().data_ptr(), grads.untyped_storage().data_ptr()}
    grads.fill_(1.0)
    adam.step(CFG.lr, None, None)
    assert torch.equal(flat[0:30], w.detach().view(-1))  # nothing sent back yet


def _kernel():
    """The compiled host kernel; skipped only where it cannot be built here (no C++ compiler, not
    x86-64), a build that fails where it can is a failure."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the host AdamW kernel is x86-64 only, this CPU is {platform.machine()}")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler (c++ or $CXX) on PATH to build the host AdamW kernel")
    kernel = host_kernel()
    assert kernel is not None, "the host AdamW kernel did not build: the log line above says why"
    return kernel


# Runs with every tail length of torch's vector code (0-17 elements past a multiple of 8 or 16),
# both weight-decay kinds, a gap between runs (padding the kernel must not touch) and a run long
# enough to be split over two threads (kGrain: 4096 units of 16).
RUNS = [(0, 3, True), (3, 20, False), (24, 41, True), (41, 64, False), (70, 70 + 16 * 4096 * 2 + 13, True)]
RUNS += [(RUNS[-1][1] + 5 + 31 * i, RUNS[-1][1] + 5 + 31 * i + 16 + i, i % 2 == 0) for i in range(18)]


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp has two forms: 1 - beta1 below 0.5 and not
def test_compiled_kernel_is_torch_fused_adamw_bit_for_bit(beta1):
    """Each vector path this CPU has (scalar, AVX2, AVX-512) against ``torch._fused_adamw_`` on
    the same runs as a list of tensors: equal bits in the parameters, moments and (divided)
    gradients, through a gradient divisor, a skipped step and steps without decay."""
    kernel = _kernel()
    paths = {"scalar": 0, "avx2": 1, "avx512": 2}
    torch.manual_seed(0)
    n = RUNS[-1][1] + 3
    init = [torch.randn(n) * 0.02, torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    for isa in range(paths[kernel.isa()] + 1):
        ours, ref = [t.clone() for t in init], [t.clone() for t in init]
        step_ours, step_ref = torch.zeros(()), torch.zeros(())
        for step, (divisor, skip) in enumerate([(None, 0.0), (4.0, 0.0), (2.0, 1.0), (None, 0.0), (0.5, 0.0)]):
            g = torch.randn(n) * 1e-3
            ours[1].copy_(g)
            ref[1].copy_(g)
            scale = torch.tensor([divisor]) if divisor else None
            found_inf = torch.tensor([skip])
            step_ours += 1
            step_ref += 1
            for want, wd in ((True, CFG.weight_decay), (False, 0.0)):
                views = [[t[lo:hi] for lo, hi, d in RUNS if d == want] for t in ref]
                torch._fused_adamw_(*views, [], [step_ref] * len(views[0]), lr=CFG.lr, beta1=beta1, beta2=CFG.beta2,
                                    weight_decay=wd, eps=CFG.eps, amsgrad=False, maximize=False, grad_scale=scale,
                                    found_inf=found_inf)
            kernel.adamw_step(*ours, run_table(RUNS), step_ours, CFG.lr, beta1, CFG.beta2, CFG.weight_decay, CFG.eps,
                              scale, found_inf, isa)
            step_ours -= skip
            step_ref -= skip
            for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ours, ref):
                assert torch.equal(a, b), f"isa {isa} step {step}: {name} differs at {(a != b).nonzero()[:5].tolist()}"


def test_compiled_kernel_refuses_what_it_cannot_read_and_writes_nothing():
    """The library reads raw pointers, so its wrapper refuses first: a state tensor off the host
    (a device's scalar here: the meta device, as a GPU's would be), of another dtype or length,
    not contiguous, a divisor that is not one host fp32 value, a run past the buffers (the
    library's own check, before it writes)."""
    kernel = _kernel()
    n = 64
    state = [torch.randn(n) for _ in range(4)]
    before = [t.clone() for t in state]
    runs, step = run_table([(0, n, True)]), torch.ones(())

    def step_with(*tensors, runs=runs, grad_scale=None):
        kernel.adamw_step(*tensors, runs, step, CFG.lr, 0.9, CFG.beta2, CFG.weight_decay, CFG.eps, grad_scale, None, -1)

    cases = [
        (lambda: step_with(state[0].double(), *state[1:]), "contiguous fp32 host tensors"),
        (lambda: step_with(state[0], torch.randn(2 * n)[::2], *state[2:]), "contiguous fp32 host tensors"),
        (lambda: step_with(state[0], torch.randn(n + 1), *state[2:]), "differ in length"),
        (lambda: step_with(*state, grad_scale=torch.ones(1, device="meta")), "grad_scale must be one fp32 host value"),
        (lambda: step_with(*state, runs=run_table([(0, n + 16, True)])), "a run lies outside the state"),
        (lambda: step_with(*state, runs=run_table([(0, n, True)]).int()), "runs must be a contiguous int64"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
    for a, b in zip(state, before):
        assert torch.equal(a, b), "a refused step wrote into the state"


def test_host_step_with_the_kernel_is_the_host_step_with_torchs():
    """HostAdamW through the compiled kernel and through torch's kernel (the fallback): the same
    bits in the masters, moments and the cast parameters, and the same step counter, through a
    divisor and a skipped fp16 step."""
    _kernel()
    _, _, flat, _, adam = _layout(torch.bfloat16)
    _, _, flat_ref, _, ref = _layout(torch.bfloat16)
    assert adam.kernel is not None
    ref.kernel = None
    for divisor, skip in [(None, 0.0), (8.0, 0.0), (8.0, 1.0), (None, 0.0)]:
        g = torch.randn(40)
        for a in (adam, ref):
            a.grad.copy_(g)
            a.step(CFG.lr, torch.tensor([divisor]) if divisor else None, torch.tensor([skip]))
            a.params_to_device()
        for a, b in zip(adam.host_tensors(), ref.host_tensors()):
            assert torch.equal(a, b)
        assert torch.equal(flat, flat_ref)
    assert adam.step_count.item() == 3


def test_compiled_kernel_runs_on_torchs_threads():
    """The kernel's split over the cores is an OpenMP region of its library: serial unless built
    with -fopenmp, and on torch's thread count (``torch.set_num_threads``), which the library's
    OpenMP runtime does not see by itself: the step and this count take it from one place
    (host_kernel.py ``_threads``)."""
    kernel = _kernel()
    before = torch.get_num_threads()
    try:
        for threads in (2, 1, 3):
            torch.set_num_threads(threads)
            assert kernel.parallel_threads() == threads
    finally:
        torch.set_num_threads(before)
