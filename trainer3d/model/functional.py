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

The elementwise work of each Function is an operator of the ``trainer3d`` library defined
here by its composition of torch operators, for every device (``CompositeExplicitAutograd``).
A device may bring a kernel of its own for an operator without the model knowing it
(trainer3d/cpu/ops.py registers fused CPU kernels); the Functions reach the operators through
one seam, ``_operator``. Under a zero-bubble pipeline schedule with ``train.compile``, inductor
is that kernel: the seam calls the composition compiled by ``torch.compile`` (``compiled``: the
backend, ``train.compile_backend``, set per module by parallel/compile.py), while the Functions, and so the autograd graph and what
it saves, stay those above.

Each backward computes only the gradients its backward pass runs on: ``ctx.needs_input_grad`` is
fixed at forward, so it also asks the autograd engine which of its inputs' nodes this pass
executes (``_needed``). A zero-bubble schedule's input step asks for the stage input's gradient
alone and its weight step for the weights' alone (parallel/pipeline/weight_grad.py): RMSNorm and
SwiGLU then compute the input half in the one and the weight half in the other, not both twice.
"""

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

SINK = "main_grad_sink"
"""The attribute of a parameter that holds its fp32 gradient sink (parallel/wgrad.py's
``MainGradSink``: ``views[weight]`` and ``accumulate(main_grad, grad_out, x)``)."""


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the operator when it is already of that dtype (``Tensor.to``
    returns ``t`` itself then, but the call still goes through the dispatcher: at the bench's
    shape such no-op casts make 28 of the 630 operators of an fp32 block's forward and backward)."""
    return t if t.dtype == dtype else t.to(dtype)


LIBRARY = torch.library.Library("trainer3d", "DEF")
COMPOSITIONS: Dict[str, Callable] = {}
"""Each operator's composition of torch operators, by name: its implementation on every device
that has no kernel of its own for it."""
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, float, int, bool))
"""The argument types the operators take as they are (any other, such as DTensor, runs the composition)."""
_COMPILED: Dict[Tuple[str, str], Callable] = {}
"""Each composition under ``torch.compile`` by backend, made on first use (dynamo is imported only
by runs that compile)."""


def _compiled(name: str, backend: str) -> Callable:
    key = (name, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(COMPOSITIONS[name], backend=backend)
    return _COMPILED[key]


def _needed(ctx, count: int):
    """Which of a Function's first ``count`` inputs get a gradient from this backward: those that
    need one and, outside torch.compile (dynamo cannot trace the engine's query; a compiled graph
    computes every gradient anyway), whose node the engine executes in this backward pass."""
    needs = ctx.needs_input_grad[:count]
    if torch.compiler.is_compiling():
        return needs
    return tuple(need and _executes(node) for need, (node, _) in zip(needs, ctx.next_functions))


def _executes(node) -> bool:
    """Whether the running backward pass executes ``node`` (or captures its gradient)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        # torch refuses to answer for a leaf that ``autograd.grad`` captures ("A leaf node was
        # passed to _will_engine_execute_node", torch/csrc/autograd/init.cpp): a leaf is in an
        # autograd.grad pass only as one of its inputs, whose gradient is wanted (the pipeline
        # stage's received input in the input step).
        return True


def _operator(schema: str, composition: Callable) -> Callable:
    """Define ``torch.ops.trainer3d.<name>`` by ``schema`` and ``composition``; return the seam
    the Functions call it through. The seam runs the composition itself inside torch.compile
    (which fuses it; the operator would be opaque to it) and for a tensor subclass such as
    DTensor (which has no sharding rule for the operator); ``compiled`` (a torch.compile backend)
    calls the composition compiled on its own by it (inductor: a kernel of its own) instead of the
    operator."""
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, composition, "CompositeExplicitAutograd")
    COMPOSITIONS[name] = composition
    op = getattr(torch.ops.trainer3d, name).default

    def call(*args, compiled: Optional[str] = None):
        if torch.compiler.is_compiling():
            return composition(*args)
        for t in args:
            if type(t) not in _PLAIN:
                return composition(*args)
        return _compiled(name, compiled)(*args) if compiled else op(*args)

    return call


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x / rms(x)) * weight, normalised in fp32 (bf16 would lose the mean square), and 1/rms
    shaped (..., 1)."""
    xf = _cast(x, torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _cast(xf * rstd, x.dtype) * weight, rstd


def _rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                       need_x: bool, need_weight: bool):
    xhat = _cast(x, torch.float32) * rstd
    grad_weight = None
    if need_weight:
        # as autograd reduces a broadcast product: in the product's dtype, over every token
        grad_weight = _cast((grad_y * _cast(xhat, x.dtype)).sum_to_size(weight.shape), weight.dtype)
    grad_x = None
    if need_x:
        g = _cast(grad_y * weight, torch.float32)
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - xhat * mean(g * xhat)), in place
        dot = (g * xhat).mean(-1, keepdim=True)
        grad_x = _cast(g.sub_(xhat.mul_(dot)).mul_(rstd), x.dtype)
    return grad_x, grad_weight


rms_norm_forward = _operator("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
                             _rms_norm_forward)
rms_norm_backward = _operator("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd, bool need_x, "
                              "bool need_weight) -> (Tensor?, Tensor?)", _rms_norm_backward)


class _RMSNorm(torch.autograd.Function):
    """y = (x / rms(x)) * weight, normalised in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, compiled: Optional[str]) -> torch.Tensor:
        y, rstd = rms_norm_forward(x, weight, eps, compiled=compiled)
        ctx.save_for_backward(x, weight, rstd)
        ctx.compiled = compiled
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        return (*rms_norm_backward(grad_y, x, weight, rstd, *_needed(ctx, 2), compiled=ctx.compiled), None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, compiled: Optional[str] = None) -> torch.Tensor:
    """(x / rms(x)) * weight; ``compiled``: its elementwise work compiled by that backend (module docstring)."""
    return _RMSNorm.apply(x, weight, eps, compiled)


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


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x: (seq, batch, heads, head_dim) rotated by the (seq, head_dim) tables, forward (``sign``
    1) or back (-1), in x's dtype."""
    return _cast(_rotate(x, cos[:, None, None, :], sin[:, None, None, :], float(sign)), x.dtype)


rotary = _operator("rotary(Tensor x, Tensor cos, Tensor sin, int sign) -> Tensor", _rotary)


class _Rotary(torch.autograd.Function):
    """x cos + rotate_half(x) sin in fp32, x: (seq, batch, heads, head_dim), tables (seq, head_dim)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, compiled: Optional[str]) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.compiled = compiled
        return rotary(x, cos, sin, 1, compiled=compiled)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return rotary(grad_y, cos, sin, -1, compiled=ctx.compiled), None, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, compiled: Optional[str] = None) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x: (seq, batch, heads, head_dim) by the fp32 tables."""
    return _Rotary.apply(x, cos, sin, compiled)


def _swiglu_backward(grad_prod: torch.Tensor, a: torch.Tensor, b: torch.Tensor, need_prod: bool,
                     need_inputs: bool):
    """silu(a) * b (for w2's gradient) where ``need_prod``, and where ``need_inputs`` the
    gradients of a and b for ``grad_prod``, the gradient of that product."""
    silu = F.silu(a)
    prod = silu * b if need_prod else None
    grad_a = grad_b = None
    if need_inputs:
        grad_a = torch.ops.aten.silu_backward(grad_prod * b, a)  # F.silu's own derivative
        grad_b = grad_prod * silu
    return prod, grad_a, grad_b


def _swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


swiglu_forward = _operator("swiglu_forward(Tensor a, Tensor b) -> Tensor", _swiglu_forward)
swiglu_backward = _operator("swiglu_backward(Tensor grad_prod, Tensor a, Tensor b, bool need_prod, bool need_inputs) "
                            "-> (Tensor?, Tensor?, Tensor?)", _swiglu_backward)


class _SwiGLULinear(torch.autograd.Function):
    """F.linear(silu(a) * b, weight) keeping a and b: the product (the linear's input) is
    recomputed in backward for the weight's gradient. With a sink (``SINK``) the weight's
    gradient is accumulated into its fp32 buffer as parallel/wgrad.py's ``linear`` does."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                sink: Optional[Any], compiled: Optional[str]) -> torch.Tensor:
        ctx.save_for_backward(a, b, weight)
        ctx.sink, ctx.compiled = sink, compiled
        ctx.main_grad = sink.views[weight] if sink is not None else None
        return F.linear(swiglu_forward(a, b, compiled=compiled), weight)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        a, b, weight = ctx.saved_tensors
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        need_a, need_b, need_weight = _needed(ctx, 3)
        need_inputs = need_a or need_b
        grad_prod = grad_2d.mm(weight).view(a.shape) if need_inputs else a  # a: unread where not asked
        prod, grad_a, grad_b = swiglu_backward(grad_prod, a, b, need_weight, need_inputs, compiled=ctx.compiled)
        grad_weight = None
        if need_weight:
            prod_2d = prod.view(-1, b.shape[-1])
            if ctx.sink is None:
                grad_weight = grad_2d.t().mm(prod_2d)
            else:
                ctx.sink.accumulate(ctx.main_grad, grad_2d, prod_2d)
        return grad_a, grad_b, grad_weight, None, None


def swiglu_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, compiled: Optional[str] = None) -> torch.Tensor:
    """``F.linear(F.silu(a) * b, weight)`` (SwiGLU's w2 applied to its gate), saving a and b only;
    ``compiled``: the gate's elementwise work compiled by that backend (module docstring)."""
    # Inside a compiled block the compiler owns the buffers (and cannot trace the sink's engine
    # query); asked before the weight's sink is read, so that dynamo guards on no sink attribute
    # and a run without the sink reuses the graph (tests/multirank/test_wgrad.py).
    sink = None if torch.compiler.is_compiling() else getattr(weight, SINK, None)
    if sink is not None and (not torch.is_grad_enabled() or not weight.requires_grad):
        sink = None
    return _SwiGLULinear.apply(a, b, weight, sink, compiled)
