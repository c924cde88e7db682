"""The communication of tensor parallelism, as autograd functions over the tp group.

Megatron-LM's two conjugate operators (Shoeybi et al. 2019, sec. 3, fig. 3), and their
sequence-parallel counterparts (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", sec. 4.2.2, fig. 5):

    name                      forward                 backward
    copy_to_tp        (f)     identity                all-reduce
    reduce_from_tp    (g)     all-reduce              identity
    gather_sequence   (g-bar) all-gather along seq    reduce-scatter along seq
    reduce_scatter_sequence   reduce-scatter along seq  all-gather along seq

A column-parallel region starts with ``copy_to_tp`` (or ``gather_sequence``) and a row-
parallel layer ends it with ``reduce_from_tp`` (or ``reduce_scatter_sequence``): every
rank computes a partial result from the same input, so the input's gradient is partial
and must be summed, and the output must be summed once.

Activations are sequence-first ``(seq, batch, ...)`` (model/transformer.py), as in
Megatron-LM (Korthikanti et al. 2022, sec. 4.2.2), so the sequence is dim 0 of contiguous
memory and a rank's sequence shard is one contiguous block: the sequence collectives
gather into and scatter out of the tensors themselves, with no copy on either side.

The two all-reduces work in place, as Megatron-LM's do (megatron/core/tensor_parallel/
mappings.py, ``_reduce``), where the tensor is provably this operator's alone:

- ``reduce_from_tp`` forward sums the output of a row-parallel matmul (or of the masked
  embedding lookup), a fresh tensor nothing else has seen. It is marked dirty, so should
  any operator ever save it for backward, autograd's version check raises instead of
  computing a wrong gradient.
- ``copy_to_tp`` backward sums the gradient of a column-parallel region's input. That
  input is consumed only by the region's column-parallel projections (wq/wk/wv, w1/w3, the
  head: the pre-hook in parallel/tensor/layers.py hands the entered tensor to them alone), so its
  gradient is a matmul's fresh output or the buffer autograd summed theirs into, which no
  other node holds. A gradient that may be shared (a residual add hands the same tensor
  to both of its inputs) must never be reduced in place: the region's boundary is where
  that cannot happen.

The sequence-parallel collectives change the shape, so they write into new buffers.
"""

import torch
import torch.distributed as dist

from trainer3d.parallel.comm import all_gather_single, reduce_scatter_single


def _size(group) -> int:
    return dist.get_world_size(group)


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the group in place (a contiguous copy first if it is not contiguous)."""
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(s, batch, ...) on each rank -> (size * s, batch, ...), rank order along the sequence."""
    x = x.contiguous()  # a no-op for the model's activations; a gradient may arrive as a view
    out = x.new_empty((_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x, group=group)
    return out


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(seq, batch, ...) partial sums -> this rank's (seq / size, batch, ...) slice of the sum."""
    size = _size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp={size}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    reduce_scatter_single(out, x, group=group)
    return out


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x.view_as(x)  # a view: an autograd Function must not return its input itself


class _Conjugate(torch.autograd.Function):
    """``forward_comm`` on the way in, ``backward_comm`` on the gradient: each operator of the
    table above is one such pair."""

    @staticmethod
    def forward(ctx, x, group, forward_comm, backward_comm):
        ctx.group, ctx.backward_comm = group, backward_comm
        return forward_comm(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_comm(grad, ctx.group), None, None, None


class _ReduceOutput(torch.autograd.Function):
    """``reduce_from_tp``: all-reduce in place forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = all_reduce_(x, group)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a column-parallel region: identity forward, all-reduce of the gradient (in
    place: see the module docstring) backward."""
    return _Conjugate.apply(x, group, _identity, all_reduce_)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a row-parallel region: all-reduce forward (in place on the fresh partial sum),
    identity backward."""
    return _ReduceOutput.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a column-parallel region from a sequence shard: all-gather forward, reduce-scatter backward."""
    return _Conjugate.apply(x, group, all_gather_seq, reduce_scatter_seq)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a row-parallel region into a sequence shard: reduce-scatter forward, all-gather backward."""
    return _Conjugate.apply(x, group, reduce_scatter_seq, all_gather_seq)


# How a layer enters (column) or leaves (row) its tensor-parallel region, by name.
ENTER = {"copy": copy_to_tp, "gather": gather_sequence}
LEAVE = {"all_reduce": reduce_from_tp, "reduce_scatter": reduce_scatter_sequence}
