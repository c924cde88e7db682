"""SwiGLU experts over tokens sorted by expert, as grouped matmuls.

Expert e's tokens are rows [offs[e-1], offs[e]) of x; each of the three projections is one
``torch._grouped_mm`` over all experts (the cumulative ``offs`` (int32) mark the groups on the
device, so nothing is read back to the host). Where the device or dtype lacks it (torch 2.13's
CPU kernel takes fp32 with 16-byte row strides; CUDA's wants bf16 on sm90+:
aten/src/ATen/native/cuda/GroupedBlas.cpp) the same products run as a loop over experts,
which reads the counts on the host once.

``grouped_swiglu`` is an autograd Function keeping what backward needs only, as
model/functional.py's ``swiglu_linear`` does for the dense block: the sorted input x and the
two projections a = x w1, b = x w3; silu(a) * b is recomputed for w2's gradient. It saves
through ``ctx.save_for_backward``, so ``saved_tensors_hooks`` (trainer3d/memory/meter.py) see
all of it.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F


def grouped_mm_usable(x: torch.Tensor, *inner: int) -> bool:
    """Whether ``torch._grouped_mm`` takes operands of x's device and dtype whose inner
    dimensions are ``inner`` (measured on CPU: fp32 with row lengths a multiple of 16 bytes;
    on CUDA: bf16 on compute capability 9.0+)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(n * x.element_size() % 16 == 0 for n in inner)
    if x.device.type == "cpu":
        return x.dtype == torch.float32 and aligned
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and aligned and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def _bounds(counts: torch.Tensor) -> List[int]:
    return [0, *counts.cumsum(0).tolist()]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x (M, K) times their expert's w[e] (K, N): (M, N)."""
    if x.dtype == w.dtype and grouped_mm_usable(x, *w.shape[1:]):
        return torch._grouped_mm(x, w, offs=offs)
    out = x.new_empty(x.shape[0], w.shape[-1])
    b = _bounds(counts)
    for e in range(w.shape[0]):
        if b[e + 1] > b[e]:
            torch.mm(x[b[e]:b[e + 1]], w[e], out=out[b[e]:b[e + 1]])
    return out


def grouped_weight_grad(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's x_e^T g_e: (E, K, N) from x (M, K) and g (M, N); zero for an expert without tokens."""
    num = counts.shape[0]
    if x.dtype == g.dtype and grouped_mm_usable(x, x.shape[1], g.shape[1]):
        return torch._grouped_mm(x.t(), g.contiguous(), offs=offs)
    out = x.new_zeros(num, x.shape[1], g.shape[1])
    b = _bounds(counts)
    for e in range(num):
        if b[e + 1] > b[e]:
            torch.mm(x[b[e]:b[e + 1]].t(), g[b[e]:b[e + 1]], out=out[e])
    return out


class _GroupedSwiGLU(torch.autograd.Function):
    """w2_e(silu(w1_e x) * w3_e x) for each row x of expert e, keeping x, w1 x and w3 x."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, counts):
        offs = counts.cumsum(0).to(torch.int32)
        a, b = grouped_mm(x, w1, offs, counts), grouped_mm(x, w3, offs, counts)
        ctx.save_for_backward(x, a, b, w1, w3, w2, counts)
        return grouped_mm(F.silu(a) * b, w2, offs, counts)

    @staticmethod
    def backward(ctx, grad_y):
        x, a, b, w1, w3, w2, counts = ctx.saved_tensors
        offs = counts.cumsum(0).to(torch.int32)
        grad_y = grad_y.contiguous()
        silu = F.silu(a)
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        grad_w2 = grouped_weight_grad(silu * b, grad_y, offs, counts) if need_w2 else None
        grad_h = grouped_mm(grad_y, w2.transpose(-2, -1), offs, counts)
        grad_b = grad_h * silu
        grad_a = torch.ops.aten.silu_backward(grad_h.mul_(b), a)  # F.silu's own derivative
        grad_w1 = grouped_weight_grad(x, grad_a, offs, counts) if need_w1 else None
        grad_w3 = grouped_weight_grad(x, grad_b, offs, counts) if need_w3 else None
        grad_x: Optional[torch.Tensor] = None
        if need_x:
            grad_x = grouped_mm(grad_a, w1.transpose(-2, -1), offs, counts)
            grad_x += grouped_mm(grad_b, w3.transpose(-2, -1), offs, counts)
        return grad_x, grad_w1, grad_w3, grad_w2, None


# Eager under train.compile: torch 2.13's fake kernel of _grouped_mm takes bf16 only (the CUDA
# kernel's rule: torch/_meta_registrations.py, ``_meta_grouped_mm_common``) while the CPU kernel
# runs fp32, and the loop fallback reads the counts on the host (a data-dependent graph break).
# The compiled block splits around the experts; both sides keep their eager numerics. The
# expert modules call it through their ``_grouped``, one of their ``EAGER_PARTS``, which
# compile wraps with ``torch.compiler.disable`` (trainer3d/parallel/compile.py ``leave_eager``).
def grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """x (tokens, dim) sorted by expert, ``counts`` (E,) tokens per expert: (tokens, dim)."""
    return _GroupedSwiGLU.apply(x, w1, w3, w2, counts)
