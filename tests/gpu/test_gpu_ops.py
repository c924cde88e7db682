"""The model's operators on a CUDA device (model/functional.py, ``torch.ops.trainer3d``): CUDA
has no kernel of its own for them, so each runs its torch composition, on the device, bit for
bit the composition called directly; the CPU kernels (trainer3d/cpu/ops.py, registered for the
CPU key) never see a CUDA tensor. The same mechanism is held on the meta device in
tests/unit/test_functional.py.

Marked ``gpu``; skips without a CUDA device (run ``pytest -m gpu tests/gpu`` on a GPU machine).
"""

import pytest
import torch

import trainer3d.cpu  # noqa: F401 - the CPU kernels registered, as in every rank
from trainer3d.model.functional import COMPOSITIONS, apply_rotary, rms_norm, swiglu_linear
from trainer3d.model.transformer import rotary_cos_sin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "runs on a machine with one: pytest -m gpu)")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operators_run_their_composition_on_cuda(dtype):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(64, 2, 4, 32, device=dev, dtype=dtype, generator=g)
    w = torch.randn(32, device=dev, generator=g)
    cos, sin = rotary_cos_sin(64, 32, 10000.0, dev)
    a, b = (torch.randn(64, 2, 96, device=dev, dtype=dtype, generator=g) for _ in range(2))
    calls = {"rms_norm_forward": (x, w, 1e-5), "rotary": (x, cos, sin, 1), "swiglu_forward": (a, b),
             "swiglu_backward": (a, a, b, True, True)}
    for name, args in calls.items():
        got = getattr(torch.ops.trainer3d, name)(*args)
        want = COMPOSITIONS[name](*args)
        for g_, w_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g_.device.type == "cuda" and torch.equal(g_, w_), name


def test_functions_train_on_cuda_as_on_cpu():
    """Forward and backward of the three Functions on CUDA in fp32 agree with the CPU (kernels
    and all) to fp32 rounding."""
    out = {}
    for dev in ("cpu", "cuda"):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(48, 2, 4, 32, generator=g).to(dev).requires_grad_(True)
        w = torch.randn(32, generator=g).to(dev).requires_grad_(True)
        a, b = (torch.randn(48, 2, 96, generator=g).to(dev).requires_grad_(True) for _ in range(2))
        w2 = torch.randn(32, 96, generator=g).to(dev).requires_grad_(True)
        cos, sin = rotary_cos_sin(48, 32, 10000.0, torch.device(dev))
        y = rms_norm(apply_rotary(x, cos, sin), w, 1e-5).sum() + swiglu_linear(a, b, w2).square().sum()
        y.backward()
        out[dev] = [t.detach().cpu() for t in (y, x.grad, w.grad, a.grad, b.grad, w2.grad)]
    for c, g_ in zip(out["cpu"], out["cuda"]):
        torch.testing.assert_close(g_, c, rtol=1e-4, atol=1e-4)


def test_compiled_operators_train_as_the_eager_ones_on_cuda():
    """``compiled="inductor"`` (a zero-bubble schedule under ``train.compile``: parallel/compile.py) runs
    each composition as inductor's CUDA kernels inside the same Functions: forward and backward
    agree with the eager operators to fp32 rounding, and every input and weight gets its gradient."""
    out = {}
    for compiled in (None, "inductor"):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(48, 2, 4, 32, generator=g).cuda().requires_grad_(True)
        w = torch.randn(32, generator=g).cuda().requires_grad_(True)
        a, b = (torch.randn(48, 2, 96, generator=g).cuda().requires_grad_(True) for _ in range(2))
        w2 = torch.randn(32, 96, generator=g).cuda().requires_grad_(True)
        cos, sin = rotary_cos_sin(48, 32, 10000.0, torch.device("cuda"))
        y = (rms_norm(apply_rotary(x, cos, sin, compiled), w, 1e-5, compiled).sum()
             + swiglu_linear(a, b, w2, compiled).square().sum())
        y.backward()
        out[compiled] = [t.detach().cpu() for t in (y, x.grad, w.grad, a.grad, b.grad, w2.grad)]
    for c, g_ in zip(out[None], out["inductor"]):
        torch.testing.assert_close(g_, c, rtol=1e-4, atol=1e-4)
