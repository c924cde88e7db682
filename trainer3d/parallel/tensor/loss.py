"""Vocabulary-parallel cross-entropy: the loss over logits sharded along the vocabulary.

Each tp rank holds the logits of its slice of the (padded) vocabulary. The full logits are
never gathered (Shoeybi et al. 2019, sec. 3: gathering them would move batch x seq x vocab
values per step); reductions over tp of one number per token do instead:

    m   = max over all ranks of the local max logit            (all-reduce MAX)
    S   = sum over all ranks of sum_j exp(z_j - m)             (all-reduce SUM)
    z_t = the target's logit, on the rank that holds it, else 0 (all-reduce SUM)
    loss per token = log S - (z_t - m)

The two sums travel in one all-reduce (S and z_t - m stacked), as Megatron-LM's fused
cross-entropy does (megatron/core/fusions/fused_cross_entropy.py: the max, then one all-reduce
of the predicted logits and the sums of exponentials concatenated): two synchronisations of the
tp group per micro-batch (per chunk, in ``chunked_head_loss``) instead of three.

The gradient is local: softmax(z) - onehot(target), restricted to this rank's columns.

A loss mask (``data.loss_mask``) arrives as targets equal to ``IGNORE_INDEX`` (trainer3d/data/loader.py):
such a token adds nothing to the loss and gets a zero gradient, and the sum over the kept tokens
is divided by ``norm``, the trainer's normaliser for the whole global batch (trainer3d/trainer.py:
``MicroBatchLoss``), not by this micro-batch's token count. Without a mask (``norm`` None) the loss
is the mean over the micro-batch's tokens.
Padded vocabulary columns (the tail of the last rank(s), present because tp must divide
the embedding rows) are cut off before anything is computed, so they never change the
loss and always get a zero gradient.

One fp32 logits-sized buffer in all, as Megatron-LM's fused vocabulary-parallel
cross-entropy keeps (megatron/core/tensor_parallel/cross_entropy.py): the shifted logits
are written into it in fp32 straight from the logits' own dtype (no fp32 copy of bf16
logits), exponentiated and normalised in place, saved as the softmax, and turned into the
gradient in place by the backward (so a graph through it can be backpropagated once).
With tp = 1 the same function is the loss, without the collectives.

The training loss does not even hold that buffer: ``chunked_head_loss`` takes the last
stage's hidden states and the head's weight and runs the same three reductions over
``train.loss_chunk_tokens`` tokens at a time, each chunk's logits formed, reduced,
differentiated and multiplied out into the gradients of the hidden states and the head's
weight, then freed (Liger-Kernel's fused linear cross-entropy; Wijmans et al. 2024, "Cut
Your Losses in Large-Vocabulary Language Models", for the same aim by recomputation). The
model's last stage then returns its hidden states (``Transformer.head_in_loss``, set by
``parallel.build_loss_fn``); inference (tools/sample.py) still forms whole logits.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.data.loss_mask import IGNORE_INDEX
from trainer3d.model.functional import SINK
from trainer3d.model.transformer import token_rows
from trainer3d.parallel.tensor.comm import ENTER
from trainer3d.parallel.tensor.layers import ColumnParallelLinear
from trainer3d.parallel.topology import ParallelDims


def vocab_range(vocab_size: int, tp: int, tp_rank: int):
    """(start, local columns, valid columns) of rank ``tp_rank``'s vocabulary slice."""
    local = -(-vocab_size // tp)
    start = tp_rank * local
    return start, local, max(0, min(local, vocab_size - start))


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(tokens, local vocab) logits of any float dtype, (tokens,) targets -> mean token loss
    (fp32) over the tp ``group`` (None: one rank holds the whole vocabulary); with ``norm``, the
    sum over the targets that are not ``IGNORE_INDEX``, divided by ``norm``."""

    @staticmethod
    def forward(ctx, logits, targets, start, valid, group, norm=None):
        n, local = logits.shape
        z = logits[:, :valid]
        if valid > 0:
            z_max = z.max(dim=-1).values.float()
        else:
            z_max = torch.full((n,), float("-inf"), device=logits.device)
        # The shift only keeps exp() in range; any m gives the same loss and gradient.
        _all_reduce(z_max, group, dist.ReduceOp.MAX)
        # The one buffer: padding columns zero (their gradient), the rest exp(z - m), later softmax.
        softmax = (torch.zeros if valid < local else torch.empty)((n, local), device=logits.device)
        exp = torch.sub(z, z_max.unsqueeze(-1), out=softmax[:, :valid]).exp_()
        sum_exp = exp.sum(dim=-1)

        if group is None and norm is None:
            here, local_t = None, targets
        else:  # an ignored target (negative) is held by no rank: no one-hot, no target logit
            local_t = targets - start
            here = (local_t >= 0) & (local_t < valid)
            local_t = local_t.masked_fill(~here, 0)
        if valid > 0:
            target_z = z.gather(1, local_t.unsqueeze(1)).squeeze(1).float() - z_max
            if here is not None:
                target_z = target_z.masked_fill(~here, 0.0)
        else:
            target_z = torch.zeros_like(z_max)
        if group is not None:  # the two sums in one all-reduce, as Megatron-LM's (module docstring)
            sums = torch.stack([sum_exp, target_z])
            _all_reduce(sums, group)
            sum_exp, target_z = sums[0], sums[1]

        token_loss = sum_exp.log() - target_z
        exp.div_(sum_exp.unsqueeze(-1))
        if norm is None:
            loss = token_loss.mean()
        else:
            keep = targets != IGNORE_INDEX
            loss = (token_loss * keep).sum() / norm
            exp.mul_(keep.unsqueeze(-1))  # an ignored token's softmax row: its gradient is zero
        ctx.save_for_backward(softmax, local_t, here)
        ctx.valid, ctx.used, ctx.norm = valid, False, norm
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("the cross-entropy's backward turns its saved softmax into the gradient in place; "
                               "it can run once per forward (no retain_graph=True through the loss)")
        ctx.used = True
        softmax, local_t, here = ctx.saved_tensors
        scale = grad_loss / (softmax.shape[0] if ctx.norm is None else ctx.norm)  # d loss / d token loss
        grad = softmax.mul_(scale)
        if ctx.valid > 0:
            rows = torch.arange(softmax.shape[0], device=softmax.device)
            onehot = scale.expand(rows.shape) if here is None else here.to(grad.dtype) * scale
            grad.index_put_((rows, local_t), -onehot, accumulate=True)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 dims: ParallelDims, norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean token cross-entropy (fp32) from ``local_logits`` (batch, seq, local vocab); the
    whole vocabulary when tp = 1. ``norm``: the kept tokens' sum divided by it (a loss mask)."""
    start, local, valid = vocab_range(vocab_size, dims.tp, dims.tp_rank)
    if local_logits.shape[-1] != local:
        raise ValueError(f"local logits have {local_logits.shape[-1]} columns, expected {local} "
                         f"(vocabulary {vocab_size} padded over tp={dims.tp})")
    group = dims.tp_group if dims.tp > 1 else None
    rows, row_targets = token_rows(local_logits, targets)
    return _VocabParallelCrossEntropy.apply(rows, row_targets, start, valid, group, norm)


def _chunk_softmax(logits, exp, local_t, group):
    """One chunk's (rows, valid) logits of this rank's vocabulary slice -> exp(z - m) written
    into ``exp`` (fp32; may be the logits themselves), the sum of exp over all ranks, the
    target's shifted logit (z_t - m, 0 where another rank holds the target), and the local
    target index with its mask (``local_t``: target - this slice's start)."""
    rows, valid = logits.shape
    here = (local_t >= 0) & (local_t < valid)
    local_t = local_t.masked_fill(~here, 0)
    if valid == 0:
        z_max = torch.full((rows,), float("-inf"), device=logits.device)
        _all_reduce(z_max, group, dist.ReduceOp.MAX)
        sum_exp, target_z = torch.zeros_like(z_max), torch.zeros_like(z_max)
    else:
        z_max = logits.max(dim=-1).values.float()
        _all_reduce(z_max, group, dist.ReduceOp.MAX)
        # read before ``exp`` may overwrite the logits
        target_z = (logits.gather(1, local_t.unsqueeze(1)).squeeze(1).float() - z_max).masked_fill(~here, 0.0)
        # an fp32 copy, then the shift: on CPU faster than one mixed-dtype subtraction into fp32
        exp = exp.copy_(logits).sub_(z_max.unsqueeze(-1)).exp_()
        sum_exp = exp.sum(dim=-1)
    if group is not None:  # the two sums in one all-reduce: one synchronisation fewer per chunk
        sums = torch.stack([sum_exp, target_z])
        _all_reduce(sums, group)
        sum_exp, target_z = sums[0], sums[1]
    return exp, sum_exp, target_z, local_t, here


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """(tokens, dim) hidden states, (local vocab, dim) head weight, (tokens,) targets -> mean
    token loss (fp32) of ``hidden @ weight.T`` over the tp ``group``, ``chunk`` tokens at a
    time: each chunk's logits are formed, reduced (max, sum of exp, target logit: the
    reductions of ``_VocabParallelCrossEntropy``, the two sums in one all-reduce), turned into their gradient and multiplied
    out, then freed. The gradients w.r.t. the hidden states and the weight are computed in
    forward, as Liger-Kernel's fused linear cross-entropy does (no matmul is repeated), and
    saved; backward only scales them by the incoming gradient (the trainer's 1/grad_accum and
    loss scale). ``grad`` False (evaluation, no_grad) computes the loss alone. ``norm``: the sum
    over targets that are not ``IGNORE_INDEX``, divided by it, in place of the mean."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, start, valid, group, chunk, sink, grad, norm=None):
        n, local = hidden.shape[0], weight.shape[0]
        denom = n if norm is None else norm
        w = weight[:valid]
        grad_hidden = torch.empty_like(hidden) if grad else None
        # fp32 accumulation over chunks, rounded to the weight's dtype once, as one matmul would
        # be; transposed, (dim, vocab), so each chunk's product reads the chunk's gradient as it lies
        grad_wt = torch.zeros(weight.shape[1], local, device=weight.device) if grad else None
        # One chunk's logits and, for 16-bit ones, their fp32 exponentials: allocated once, reused
        # by every chunk (the 16-bit gradient is written back over the logits).
        logits_buf = torch.empty(min(chunk, n), valid, dtype=hidden.dtype, device=hidden.device)
        exp_buf = logits_buf if hidden.dtype == torch.float32 else torch.empty(logits_buf.shape, device=hidden.device)
        total = torch.zeros((), device=hidden.device)
        for r0 in range(0, n, chunk):
            h, t = hidden[r0:r0 + chunk], targets[r0:r0 + chunk]
            logits = torch.mm(h, w.t(), out=logits_buf[:h.shape[0]])
            exp, sum_exp, target_z, local_t, here = _chunk_softmax(logits, exp_buf[:h.shape[0]], t - start, group)
            token_loss = sum_exp.log() - target_z
            keep = None if norm is None else t != IGNORE_INDEX
            total += (token_loss if keep is None else token_loss * keep).sum()
            if grad and valid > 0:
                # d mean / d logits = (softmax - onehot(target)) / n (masked: kept rows only, / norm),
                # then cast as autograd casts a gradient to its input's dtype
                if keep is None:
                    grad_z = exp.div_((sum_exp * n).unsqueeze(-1))
                else:
                    grad_z = exp.mul_((keep / (sum_exp * norm)).unsqueeze(-1))
                rows = torch.arange(h.shape[0], device=h.device)
                grad_z.index_put_((rows, local_t), here.to(grad_z.dtype) / -denom, accumulate=True)
                g = logits.copy_(grad_z)
                torch.mm(g, w, out=grad_hidden[r0:r0 + chunk])
                grad_wt[:, :valid].add_(h.t().mm(g))
            elif grad:
                grad_hidden[r0:r0 + chunk].zero_()
        if grad:
            ctx.save_for_backward(grad_hidden, grad_wt.to(weight.dtype).t().contiguous())
        ctx.grad, ctx.sink = grad, sink
        ctx.main_grad = sink.views[weight] if sink is not None else None
        return total / denom

    @staticmethod
    def backward(ctx, grad_loss):
        if not ctx.grad:
            raise RuntimeError("the chunked loss ran without gradients (grad=False) and has no backward")
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_h = grad_hidden * grad_loss if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            if ctx.sink is None:
                grad_w = grad_weight * grad_loss
            elif torch._C._will_engine_execute_node(ctx.next_functions[1][0]):  # see parallel/wgrad.py
                ctx.main_grad.addcmul_(grad_weight, grad_loss)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def head_rows(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, vocab_size: int, dims: ParallelDims):
    """The last stage's ``hidden`` (seq, batch, dim), sequence-first as the model returns it (a
    sequence shard under sequence parallelism), as the rows the head reads: (rows, dim) hidden
    states with their (rows,) targets from batch-first ``targets``, the head's weight, this
    rank's vocabulary slice (start, valid columns) and the tp group (None: one rank). ``head``:
    the model's ``output``, an ``nn.Linear`` or a ``ColumnParallelLinear`` (its region opened
    here as its forward would)."""
    if isinstance(head, ColumnParallelLinear) and head.input_comm is not None:
        hidden = ENTER[head.input_comm](hidden, head.tp_group)
    weight = head.weight
    start, local, valid = vocab_range(vocab_size, dims.tp, dims.tp_rank)
    if weight.shape[0] != local:
        raise ValueError(f"the head has {weight.shape[0]} rows, expected {local} "
                         f"(vocabulary {vocab_size} padded over tp={dims.tp})")
    group = dims.tp_group if dims.tp > 1 else None
    rows = hidden.flatten(0, 1)  # sequence-major tokens: (seq, batch) -> rows
    row_targets = targets.t().flatten()  # the same order (a copy of the integer targets)
    return rows, weight, row_targets, start, valid, group


def chunked_head_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, vocab_size: int,
                      dims: ParallelDims, chunk_tokens: int, norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean token cross-entropy (fp32) of ``head`` applied to the last stage's ``hidden``
    against ``targets`` (as ``head_rows`` reads them), never holding more than
    ``chunk_tokens`` rows of logits; with ``norm`` (data.loss_mask) the kept tokens' sum
    divided by it instead."""
    rows, weight, row_targets, start, valid, group = head_rows(hidden, head, targets, vocab_size, dims)
    grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    sink = getattr(weight, SINK, None) if grad and weight.requires_grad else None
    return _ChunkedHeadCrossEntropy.apply(rows, weight, row_targets, start, valid, group, chunk_tokens, sink, grad,
                                          norm)


def chunked_loss_fn(cfg: Config, dims: ParallelDims, head: nn.Module):
    """(hidden, targets) -> mean token loss through ``head``, chunk by chunk (``chunked_head_loss``)."""
    vocab_size, chunk = cfg.model.vocab_size, cfg.train.loss_chunk_tokens

    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor, norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        return chunked_head_loss(hidden, head, targets, vocab_size, dims, chunk, norm)

    return loss_fn


def vocab_parallel_loss_fn(cfg: Config, dims: ParallelDims):
    """(local_logits, targets) -> mean token loss, as ``parallel.build_loss_fn`` wants it
    (also for tp = 1: one fp32 logits-sized buffer, where ``F.cross_entropy`` on an fp32
    copy of the logits keeps the log-softmax and allocates two more in backward)."""
    vocab_size = cfg.model.vocab_size

    def loss_fn(local_logits: torch.Tensor, targets: torch.Tensor, norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, targets, vocab_size, dims, norm)

    return loss_fn
