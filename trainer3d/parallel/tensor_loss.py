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
"""

import torch
import torch.distributed as dist

from trainer3d.config import Config
from trainer3d.topology import ParallelDims


def vocab_range(vocab_size: int, tp: int, tp_rank: int):
    """(start, local columns, valid columns) of rank ``tp_rank``'s vocabulary slice."""
    local = -(-vocab_size // tp)
    start = tp_rank * local
    return start, local, max(0, min(local, vocab_size - start))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(tokens, local vocab) fp32 logits, (tokens,) targets -> mean token loss over tp."""

    @staticmethod
    def forward(ctx, logits, targets, start, valid, group):
        z = logits[:, :valid]
        if valid > 0:
            z_max = z.max(dim=-1).values
        else:
            z_max = torch.full(logits.shape[:1], float("-inf"), device=logits.device, dtype=logits.dtype)
        # The shift only keeps exp() in range; any m gives the same loss and gradient.
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        exp = (z - z_max.unsqueeze(-1)).exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        local_t = targets - start
        here = (local_t >= 0) & (local_t < valid)
        local_t = local_t.masked_fill(~here, 0)
        if valid > 0:
            target_z = z.gather(1, local_t.unsqueeze(1)).squeeze(1) - z_max
            target_z = target_z.masked_fill(~here, 0.0)
        else:
            target_z = torch.zeros_like(z_max)
        dist.all_reduce(target_z, group=group)

        loss = (sum_exp.log() - target_z).mean()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), here, local_t)  # softmax
        ctx.local_columns = logits.shape[1]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, here, local_t = ctx.saved_tensors
        scale = grad_loss / softmax.shape[0]  # d mean / d token loss
        grad_valid = softmax * scale
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        if softmax.shape[1] > 0:
            grad_valid[rows, local_t] -= here.to(softmax.dtype) * scale
        grad = grad_valid.new_zeros((softmax.shape[0], ctx.local_columns))
        grad[:, :softmax.shape[1]] = grad_valid
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 dims: ParallelDims) -> torch.Tensor:
    """Mean token cross-entropy (fp32) from ``local_logits`` (batch, seq, local vocab)."""
    start, local, valid = vocab_range(vocab_size, dims.tp, dims.tp_rank)
    if local_logits.shape[-1] != local:
        raise ValueError(f"local logits have {local_logits.shape[-1]} columns, expected {local} "
                         f"(vocabulary {vocab_size} padded over tp={dims.tp})")
    return _VocabParallelCrossEntropy.apply(local_logits.flatten(0, 1).float(), targets.flatten(0, 1),
                                            start, valid, dims.tp_group)


def vocab_parallel_loss_fn(cfg: Config, dims: ParallelDims):
    """(local_logits, targets) -> mean token loss, as ``parallel.build_loss_fn`` wants it."""
    vocab_size = cfg.model.vocab_size

    def loss_fn(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, targets, vocab_size, dims)

    return loss_fn
