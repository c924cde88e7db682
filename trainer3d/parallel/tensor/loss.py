"""Vocabulary-parallel cross-entropy: the loss over logits sharded along the vocabulary.

Each tp rank holds the logits of its slice of the (padded) vocabulary. The full logits are
never gathered (Shoeybi et al. 2019, sec. 3: gathering them would move batch x seq x vocab
values per step); three all-reduces over tp of one number per token do instead:

    m   = max over all ranks of the local max logit            (all-reduce MAX)
    S   = sum over all ranks of sum_j exp(z_j - m)             (all-reduce SUM)
    z_t = the target's logit, on the rank that holds it, else 0 (all-reduce SUM)
    loss per token = log S - (z_t - m)

The gradient is local: softmax(z) - onehot(target), restricted to this rank's columns.
Padded vocabulary columns (the tail of the last rank(s), present because tp must divide
the embedding rows) are cut off before anything is computed, so they never change the
loss and always get a zero gradient.

One fp32 logits-sized buffer in all, as Megatron-LM's fused vocabulary-parallel
cross-entropy keeps (megatron/core/tensor_parallel/cross_entropy.py): the shifted logits
are written into it in fp32 straight from the logits' own dtype (no fp32 copy of bf16
logits), exponentiated and normalised in place, saved as the softmax, and turned into the
gradient in place by the backward (so a graph through it can be backpropagated once).
With tp = 1 the same function is the loss, without the collectives.
"""

import torch
import torch.distributed as dist

from trainer3d.config.schema import Config
from trainer3d.model.transformer import token_rows
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
    (fp32) over the tp ``group`` (None: one rank holds the whole vocabulary)."""

    @staticmethod
    def forward(ctx, logits, targets, start, valid, group):
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
        _all_reduce(sum_exp, group)

        if group is None:
            here, local_t = None, targets
        else:
            local_t = targets - start
            here = (local_t >= 0) & (local_t < valid)
            local_t = local_t.masked_fill(~here, 0)
        if valid > 0:
            target_z = z.gather(1, local_t.unsqueeze(1)).squeeze(1).float() - z_max
            if here is not None:
                target_z = target_z.masked_fill(~here, 0.0)
        else:
            target_z = torch.zeros_like(z_max)
        _all_reduce(target_z, group)

        loss = (sum_exp.log() - target_z).mean()
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, here)
        ctx.valid, ctx.used = valid, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("the cross-entropy's backward turns its saved softmax into the gradient in place; "
                               "it can run once per forward (no retain_graph=True through the loss)")
        ctx.used = True
        softmax, local_t, here = ctx.saved_tensors
        scale = grad_loss / softmax.shape[0]  # d mean / d token loss
        grad = softmax.mul_(scale)
        if ctx.valid > 0:
            rows = torch.arange(softmax.shape[0], device=softmax.device)
            onehot = scale.expand(rows.shape) if here is None else here.to(grad.dtype) * scale
            grad.index_put_((rows, local_t), -onehot, accumulate=True)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 dims: ParallelDims) -> torch.Tensor:
    """Mean token cross-entropy (fp32) from ``local_logits`` (batch, seq, local vocab); the
    whole vocabulary when tp = 1."""
    start, local, valid = vocab_range(vocab_size, dims.tp, dims.tp_rank)
    if local_logits.shape[-1] != local:
        raise ValueError(f"local logits have {local_logits.shape[-1]} columns, expected {local} "
                         f"(vocabulary {vocab_size} padded over tp={dims.tp})")
    group = dims.tp_group if dims.tp > 1 else None
    rows, row_targets = token_rows(local_logits, targets)
    return _VocabParallelCrossEntropy.apply(rows, row_targets, start, valid, group)


def vocab_parallel_loss_fn(cfg: Config, dims: ParallelDims):
    """(local_logits, targets) -> mean token loss, as ``parallel.build_loss_fn`` wants it
    (also for tp = 1: one fp32 logits-sized buffer, where ``F.cross_entropy`` on an fp32
    copy of the logits keeps the log-softmax and allocates two more in backward)."""
    vocab_size = cfg.model.vocab_size

    def loss_fn(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, targets, vocab_size, dims)

    return loss_fn
