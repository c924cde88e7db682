"""The host step of ZeRO-Offload (trainer3d/parallel/zero/offload.py: ``HostAdamW``) against
torch's own ``torch.optim.AdamW`` (the non-fused reference implementation): a matrix with
weight decay and a norm weight without, owned in two pieces with padding between them, the
gradients divided by a host divisor (clip coefficient x loss scale), an fp16 overflow skipped;
bf16 parameters come back as the masters' cast.
"""

import pytest
import torch
from torch import nn

from trainer3d.config.schema import OptimConfig
from trainer3d.optim.adamw import segments_of
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
