"""Sequence parallelism's column-parallel entry, keeping the sequence shard for backward.

Under sequence parallelism a column-parallel region opens with an all-gather of the
sequence-sharded input (comm.py, ``gather_sequence``). Computed as "gather, then the
projections", autograd keeps the gathered input (p sbh) for the weight gradients of wq, wk
and wv (or w1 and w3, or the head). Megatron-LM keeps the shard instead (p sbh / t) and
all-gathers it again in backward (Korthikanti et al. 2022, sec. 4.2.2, "Reducing Activation
Recomputation in Large Transformer Models"; megatron/core/tensor_parallel/layers.py,
``LinearWithGradAccumulationAndAsyncCommunication``), overlapping that gather with the input
gradient's matmuls and the input gradient's reduce-scatter with the weight gradients'.

``gathered_linears`` does so for all the projections that share one input at once: one
all-gather forward, one saved shard, one all-gather and one reduce-scatter backward. Low-
precision weights with a ``MainGradSink`` (parallel/wgrad.py) get their gradients added into
the fp32 buffer as there. Saved tensors go through ``ctx.save_for_backward`` only, so
``saved_tensors_hooks`` (trainer3d/memory/meter.py) see exactly the shard and the weights.

``SequenceParallelEntry`` is the forward pre-hook that applies it to a module's column-
parallel projections: it computes their outputs from the module's sequence-sharded input
and hands each projection its own (``ColumnParallelLinear.take_entered``), so the model code
(model/transformer.py) calls its projections as always. Without a gradient (evaluation), or
inside a compiled block, the region opens with the plain all-gather.
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer3d.parallel.comm import all_gather_single, reduce_scatter_single
from trainer3d.parallel.tensor.comm import gather_sequence
from trainer3d.parallel.wgrad import SINK


def _gather(shard: torch.Tensor, group, async_op: bool):
    shard = shard.contiguous()
    full = shard.new_empty((dist.get_world_size(group) * shard.shape[0], *shard.shape[1:]))
    work = all_gather_single(full, shard, group=group, async_op=async_op)
    return full, work


class _GatheredLinears(torch.autograd.Function):
    """(shard, group, *weights) -> one ``F.linear(all_gather(shard), w)`` per weight; saves the shard."""

    @staticmethod
    def forward(ctx, shard, group, *weights):
        full, _ = _gather(shard, group, async_op=False)
        outs = tuple(F.linear(full, w) for w in weights)
        ctx.save_for_backward(shard, *weights)
        ctx.group = group
        sinks = [getattr(w, SINK, None) for w in weights]
        ctx.sinks = sinks
        ctx.main_grads = [s.views[w] if s is not None else None for s, w in zip(sinks, weights)]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        shard, *weights = ctx.saved_tensors
        full, gather = _gather(shard, ctx.group, async_op=True)  # overlapped with the input gradient
        grad_full = None
        for g, w in zip(grads, weights):
            if g is not None:
                part = g.matmul(w)
                grad_full = part if grad_full is None else grad_full.add_(part)
        gather.wait()
        scatter, grad_shard = None, None
        if ctx.needs_input_grad[0] and grad_full is not None:
            grad_full = grad_full.contiguous()
            grad_shard = grad_full.new_empty(shard.shape)
            # overlapped with the weight gradients
            scatter = reduce_scatter_single(grad_shard, grad_full, group=ctx.group, async_op=True)
        full_2d = full.reshape(-1, full.shape[-1])
        weight_grads: List[Optional[torch.Tensor]] = []
        for i, g in enumerate(grads):
            weight_grads.append(None)
            if g is None or not ctx.needs_input_grad[2 + i]:
                continue
            g_2d = g.reshape(-1, g.shape[-1])
            sink = ctx.sinks[i]
            if sink is None:
                weight_grads[-1] = g_2d.t().mm(full_2d)
            # next_functions lists the tensor inputs only (shard, *weights): weight i is 1 + i
            elif torch._C._will_engine_execute_node(ctx.next_functions[1 + i][0]):
                sink.accumulate(ctx.main_grads[i], g_2d, full_2d)  # as parallel/wgrad.py's linear
        if scatter is not None:
            scatter.wait()
        return (grad_shard, None, *weight_grads)


def gathered_linears(shard: torch.Tensor, weights: Sequence[nn.Parameter], group) -> tuple:
    """The outputs of ``weights`` applied to the sequence all-gather of ``shard`` (seq/t, batch, in)."""
    return _GatheredLinears.apply(shard, group, *weights)


class SequenceParallelEntry:
    """Forward pre-hook opening a module's column-parallel region from a sequence shard: its
    projections' outputs computed at once from the shard (``gathered_linears``)."""

    def __init__(self, projections: List[nn.Module], group):
        self.projections, self.group = projections, group

    def __call__(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        x = args[0]
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return (gather_sequence(x, self.group), *args[1:])
        outs = gathered_linears(x, [p.weight for p in self.projections], self.group)
        for proj, out in zip(self.projections, outs):
            proj.entered = (x, out)
        return None
