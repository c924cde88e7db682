"""RMSNorm, rotary embedding and SwiGLU as autograd Functions that keep only what backward needs.

Composed from torch operators, autograd keeps every operator's inputs: RMSNorm an fp32 copy
of its input and its normalised value, SwiGLU silu(w1 x) and the product next to w1 x and
w3 x. Cheap elementwise work is recomputed in backward instead, as torch.compile's min-cut
partitioner does (torch/_functorch/partitioners.py) and fused kernels such as Liger-Kernel's
RMSNorm and SwiGLU do. Each Function saves through ``ctx.save_for_backward`` only, so
``saved_tensors_hooks`` sees all of it (trainer3d/memory/meter.py) and activation
checkpointing can take it over:

    rms_norm      x in the activation dtype and 1/rms in fp32 (one number per token)
    apply_rotary  the cos/sin tables alone (the rotation is linear in x)
    swiglu_linear w1 x and w3 x; silu and the product are recomputed for w2's gradients

Forward values are those of the plain composition, operator for operator (the norm in fp32,
the rotation in fp32, silu and the product in the activation dtype); backward computes the
same derivatives, with fp32 inside where the composition upcasts. tests/unit/test_functional.py
holds each Function to the composition, in values, gradients and saved bytes.
"""

from typing import Any, Optional

import torch
import torch.nn.functional as F

SINK = "main_grad_sink"
"""The attribute of a parameter that holds its fp32 gradient sink (parallel/wgrad.py's
``MainGradSink``: ``views[weight]`` and ``accumulate(main_grad, grad_out, x)``)."""


class _RMSNorm(torch.autograd.Function):
    """y = (x / rms(x)) * weight, normalised in fp32 (bf16 would lose the mean square)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # as autograd reduces a broadcast product: in the product's dtype, over every token
            grad_weight = (grad_y * xhat.type_as(x)).sum_to_size(weight.shape).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad_y * weight).float()
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - xhat * mean(g * xhat))
            grad_x = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Pairs (i, i + d/2) turned a quarter: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate_half_back(x: torch.Tensor) -> torch.Tensor:
    """The transpose of ``_rotate_half``: (u1, u2) -> (u2, -u1)."""
    u1, u2 = x.chunk(2, dim=-1)
    return torch.cat([u2, -u1], dim=-1)


class _Rotary(torch.autograd.Function):
    """x cos + rotate_half(x) sin in fp32, x: (seq, batch, heads, head_dim), tables (seq, head_dim)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        ctx.save_for_backward(cos, sin)
        return (x.float() * cos + _rotate_half(x).float() * sin).type_as(x)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        cos, sin = ctx.saved_tensors
        g = grad_y.float()
        return (g * cos + _rotate_half_back(g * sin)).to(grad_y.dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x: (seq, batch, heads, head_dim) by the fp32 tables."""
    return _Rotary.apply(x, cos, sin)


class _SwiGLULinear(torch.autograd.Function):
    """F.linear(silu(a) * b, weight) keeping a and b: the product (the linear's input) is
    recomputed in backward for the weight's gradient. With a sink (``SINK``) the weight's
    gradient is accumulated into its fp32 buffer as parallel/wgrad.py's ``linear`` does."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                sink: Optional[Any]) -> torch.Tensor:
        ctx.save_for_backward(a, b, weight)
        ctx.sink = sink
        ctx.main_grad = sink.views[weight] if sink is not None else None
        return F.linear(F.silu(a) * b, weight)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        a, b, weight = ctx.saved_tensors
        af = a.float()
        sig = torch.sigmoid(af)
        silu = (af * sig).to(a.dtype)  # F.silu's value in the activation dtype
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[2]:
            prod_2d = (silu * b).reshape(-1, b.shape[-1])
            if ctx.sink is None:
                grad_weight = grad_2d.t().mm(prod_2d)
            elif torch._C._will_engine_execute_node(ctx.next_functions[2][0]):  # see wgrad.linear
                ctx.sink.accumulate(ctx.main_grad, grad_2d, prod_2d)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_prod = grad_2d.mm(weight).view(*grad_y.shape[:-1], weight.shape[1])
            grad_b = grad_prod * silu
            # silu'(a) = sig (1 + a (1 - sig)), in fp32 as torch's silu_backward computes it
            grad_a = ((grad_prod * b).float() * (sig * (1 + af * (1 - sig)))).to(a.dtype)
        return grad_a, grad_b, grad_weight, None


def swiglu_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(F.silu(a) * b, weight)`` (SwiGLU's w2 applied to its gate), saving a and b only."""
    sink = getattr(weight, SINK, None)
    # Inside a compiled block the compiler owns the buffers (and cannot trace the sink's engine query).
    if sink is not None and (not torch.is_grad_enabled() or not weight.requires_grad
                             or torch.compiler.is_compiling()):
        sink = None
    return _SwiGLULinear.apply(a, b, weight, sink)
