"""Low-precision weight gradients accumulated straight into the fp32 gradient buffer.

With ``train.dtype`` bf16 or fp16 (ZeRO stages 0/1), autograd would give every weight a
fresh low-precision ``.grad`` per micro-batch (the weight-gradient matmul's output), which
the bucket hook then adds into the fp32 buffer (parallel/zero/buckets.py) and frees: one
allocation of every weight's size per micro-batch. Megatron-LM's
``gradient_accumulation_fusion`` avoids it: the linear layer's backward accumulates its
weight gradient into the parameter's fp32 ``main_grad`` itself (megatron/core/
tensor_parallel/layers.py, ``LinearWithGradAccumulationAndAsyncCommunication``).

``linear`` does the same for every linear layer (tp=1 ``nn.Linear``, and the column/row-
parallel ones of parallel/tensor/layers.py) whose weight the optimizer has given a
``MainGradSink``, and so do SwiGLU's w2 (``swiglu_linear``, model/functional.py) and the
chunked loss's head (``chunked_head_loss``, parallel/tensor/loss.py), which run their matmuls
themselves:

- on CUDA, where ``torch.addmm`` takes ``out_dtype=torch.float32`` with bf16/fp16 inputs
  (aten/src/ATen/native/cuda/Blas.cpp, ``_addmm_dtype_out_cuda``), the matmul accumulates
  into the fp32 view in one kernel (fp32 accumulation throughout: not bit-identical to
  rounding each micro-batch's gradient to bf16 first, and more accurate);
- elsewhere (CPU has no such kernel in torch 2.13: ``aten::addmm.dtype_out`` is not
  implemented there), the gradient is computed into one reused low-precision scratch
  buffer, sized for the largest weight, and added from there: the same operators on the same
  operands as autograd's own, so the fp32 buffer ends bit-identical to the plain path.

The backward returns no weight gradient. Autograd still runs the weight's
``AccumulateGrad`` node (with nothing to accumulate), so its post-accumulate hook still
fires once per micro-batch and the bucket's dp reduction starts when it did before. A
weight used elsewhere too (a tied head's embedding) gets the other uses' gradient through
``.grad`` as before. fp32 weights never get a sink: autograd already accumulates into their
fp32 view (``.grad`` is the view), so fp32 training is unchanged. Blocks compiled with
``train.compile`` keep autograd's path (the compiler owns their buffers); the layers outside
them (the head) still use the sink.
"""

from typing import Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer3d.model.functional import SINK  # the attribute of a parameter that holds its MainGradSink


def _fused_addmm_works(device: torch.device) -> bool:
    """Whether this torch has the fp32-accumulating low-precision matmul on ``device`` (CUDA,
    recent releases; never on CPU): tried once on a 16 x 16 block."""
    if device.type != "cuda":
        return False
    block = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    out = torch.zeros(16, 16, dtype=torch.float32, device=device)
    try:
        torch.addmm(out, block, block, out_dtype=torch.float32, out=out)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class MainGradSink:
    """Where the weight gradients of a set of low-precision parameters go: each one's fp32
    view of the flat gradient buffer (``views``)."""

    def __init__(self, views: Dict[nn.Parameter, torch.Tensor]):
        self.views = views
        self.largest = max((p.numel() for p in views), default=0)
        self.scratch: Optional[torch.Tensor] = None
        device = next(iter(views.values())).device if views else torch.device("cpu")
        self.fused = _fused_addmm_works(device)
        """Whether ``addmm(out_dtype=float32)`` accumulates here (decided once, so an error of a
        real backward is never taken for a missing kernel)."""
        for p in views:
            setattr(p, SINK, self)

    def detach(self) -> None:
        """Give the parameters back to autograd's plain ``.grad`` path."""
        for p in self.views:
            if getattr(p, SINK, None) is self:
                delattr(p, SINK)

    def accumulate(self, main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        """``main_grad += grad_out^T x`` (both 2-D in the weight's dtype, rows are tokens)."""
        if self.fused:
            torch.addmm(main_grad, grad_out.t(), x, out_dtype=torch.float32, out=main_grad)
            return
        if self.scratch is None:
            self.scratch = torch.empty(self.largest, dtype=x.dtype, device=x.device)
        grad = self.scratch[:main_grad.numel()].view(main_grad.shape)
        torch.mm(grad_out.t(), x, out=grad)
        main_grad.add_(grad)


class _LinearIntoMainGrad(torch.autograd.Function):
    """``F.linear(x, weight)``; backward accumulates the weight's gradient into ``main_grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, sink: MainGradSink) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # The view, not the Parameter: under activation checkpointing the saved weight comes
        # back as another tensor object (torch/utils/checkpoint.py unpacks recomputed copies).
        ctx.sink, ctx.main_grad = sink, sink.views[weight]
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        # 2-D matmuls viewed back, as autograd's own backward of ``F.linear`` computes them.
        grad_x = grad_2d.mm(weight).view(*grad_out.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        # Only in a backward that accumulates the weight's gradient: ``torch.autograd.grad``
        # for the inputs alone (the pipeline stage's shape inference runs one on its first
        # step, torch/distributed/pipelining/stage.py) must leave the buffer alone, as
        # autograd leaves ``.grad`` alone then.
        if torch._C._will_engine_execute_node(ctx.next_functions[1][0]):
            ctx.sink.accumulate(ctx.main_grad, grad_2d, x.reshape(-1, x.shape[-1]))
        return grad_x, None, None


def linear(x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias); the weight gradient goes into its sink if it has one."""
    # Inside a torch.compile'd block (train.compile) the plain path: dynamo cannot trace the
    # backward's engine query and would split the block's graph at every projection. Asked
    # first, so that dynamo reads no sink attribute and guards on none (a run without the sink
    # reuses the graph).
    if torch.compiler.is_compiling():
        return F.linear(x, weight)
    sink = getattr(weight, SINK, None)
    if sink is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight)
    return _LinearIntoMainGrad.apply(x, weight, sink)


class RoutedLinear(nn.Linear):
    """A bias-free ``nn.Linear`` that computes through ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def route_linear_layers(chunks: Iterable[nn.Module]) -> int:
    """Make the model's bias-free ``nn.Linear`` layers compute through ``linear`` (the tensor-
    parallel layers always do); returns how many. Swaps their class for ``RoutedLinear``, so
    parameter names do not change, and every layer keeps one forward shared by its class: a
    ``forward`` replaced on each instance (a ``functools.partial``) is an object dynamo guards
    on by identity, so under ``train.compile`` every block of a bf16 run recompiled, and past
    ``torch._dynamo.config.recompile_limit`` (8) the rest ran eager
    (tests/multirank/test_wgrad.py counts the graphs)."""
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if type(module) is nn.Linear and module.bias is None:
                module.__class__ = RoutedLinear
                count += 1
    return count


def low_precision_sink(params: List[nn.Parameter], grad_view, dtype: torch.dtype) -> Optional[MainGradSink]:
    """A sink over ``params`` when they are bf16/fp16 (their ``grad_view`` is fp32); None for fp32."""
    if dtype == torch.float32:
        return None
    return MainGradSink({p: grad_view(p) for p in params if p.dim() == 2})
