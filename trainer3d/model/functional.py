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

from trainer3d.model import cpu_kernels

SINK = "main_grad_sink"
"""The attribute of a parameter that holds its fp32 gradient sink (parallel/wgrad.py's
``MainGradSink``: ``views[weight]`` and ``accumulate(main_grad, grad_out, x)``)."""


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the operator when it is already of that dtype (``Tensor.to``
    returns ``t`` itself then, but the call still goes through the dispatcher: at the bench's
    shape such no-op casts make 28 of the 630 operators of an fp32 block's forward and backward)."""
    return t if t.dtype == dtype else t.to(dtype)


class _RMSNorm(torch.autograd.Function):
    """y = (x / rms(x)) * weight, normalised in fp32 (bf16 would lose the mean square)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_kernels.usable(x, weight) and weight.shape == x.shape[-1:]:
            y, rstd = cpu_kernels.rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return y
        xf = _cast(x, torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return _cast(xf * rstd, x.dtype) * weight

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        if cpu_kernels.usable(grad_y, x, weight):
            return (*cpu_kernels.rms_norm_backward(grad_y, x, weight, rstd, *ctx.needs_input_grad[:2]), None)
        xhat = _cast(x, torch.float32) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # as autograd reduces a broadcast product: in the product's dtype, over every token
            grad_weight = _cast((grad_y * _cast(xhat, x.dtype)).sum_to_size(weight.shape), weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = _cast(grad_y * weight, torch.float32)
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - xhat * mean(g * xhat)), in place
            dot = (g * xhat).mean(-1, keepdim=True)
            grad_x = _cast(g.sub_(xhat.mul_(dot)).mul_(rstd), x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x cos + R(x) sin in fp32, R turning pairs (i, i + d/2) a quarter: (x1, x2) -> (-x2, x1)
    (``sign`` 1), or back, its transpose: (x1, x2) -> (x2, -x1) (``sign`` -1). Each element is
    one product plus one, rounded as ``x * cos + cat([-x2, x1]) * sin`` rounds it, without
    building the rotated copy."""
    xf = _cast(x, torch.float32)
    out = xf * cos
    x1, x2 = xf.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    o1.sub_(x2 * s1) if sign > 0 else o1.add_(x2 * s1)
    o2.add_(x1 * s2) if sign > 0 else o2.sub_(x1 * s2)
    return out


class _Rotary(torch.autograd.Function):
    """x cos + rotate_half(x) sin in fp32, x: (seq, batch, heads, head_dim), tables (seq, head_dim)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        if cpu_kernels.rotary_usable(x, cos, sin):
            return cpu_kernels.rotary(x, cos, sin, 1)
        return _cast(_rotate(x, cos[:, None, None, :], sin[:, None, None, :], 1.0), x.dtype)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if cpu_kernels.rotary_usable(grad_y, cos, sin):
            return cpu_kernels.rotary(grad_y, cos, sin, -1), None, None
        return _cast(_rotate(grad_y, cos[:, None, None, :], sin[:, None, None, :], -1.0), grad_y.dtype), None, None


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
        if cpu_kernels.usable(a, b) and a.shape == b.shape:
            return F.linear(cpu_kernels.swiglu_forward(a, b), weight)
        return F.linear(F.silu(a) * b, weight)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        a, b, weight = ctx.saved_tensors
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        if cpu_kernels.usable(a, b, grad_2d, weight) and a.shape == b.shape:
            return _SwiGLULinear.fused_backward(ctx, grad_2d, a, b, weight)
        silu = F.silu(a)
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
            grad_a = torch.ops.aten.silu_backward(grad_prod.mul_(b), a)  # F.silu's own derivative
        return grad_a, grad_b, grad_weight, None

    @staticmethod
    def fused_backward(ctx, grad_2d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor):
        """``backward`` with the elementwise work in one pass of cpu_kernels.py's SwiGLU kernel."""
        need_inputs = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_prod = grad_2d.mm(weight).view(a.shape) if need_inputs else a  # a: unread where not asked
        need_weight = ctx.needs_input_grad[2] and (
            ctx.sink is None or torch._C._will_engine_execute_node(ctx.next_functions[2][0]))
        prod, grad_a, grad_b = cpu_kernels.swiglu_backward(grad_prod, a, b, need_weight, need_inputs)
        grad_weight = None
        if need_weight:
            prod_2d = prod.view(-1, b.shape[-1])
            if ctx.sink is None:
                grad_weight = grad_2d.t().mm(prod_2d)
            else:
                ctx.sink.accumulate(ctx.main_grad, grad_2d, prod_2d)
        return grad_a, grad_b, grad_weight, None


def swiglu_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(F.silu(a) * b, weight)`` (SwiGLU's w2 applied to its gate), saving a and b only."""
    sink = getattr(weight, SINK, None)
    # Inside a compiled block the compiler owns the buffers (and cannot trace the sink's engine query).
    if sink is not None and (not torch.is_grad_enabled() or not weight.requires_grad
                             or torch.compiler.is_compiling()):
        sink = None
    return _SwiGLULinear.apply(a, b, weight, sink)
