"""Evaluation's loss: the sum of token cross-entropies over the tokens that count.

Evaluation reads whole global batches, and the last one is partial where the validation
windows are not a multiple of the global batch: the windows past the end are padding, their
targets ``PAD_TARGET`` (trainer3d/data/loader.py), so every micro-batch keeps its shape through
the pipeline. A micro-batch's loss here is therefore a *sum* over the tokens whose target is a
token id; the evaluator divides the sum over all micro-batches and ranks by the number of
validation tokens (trainer3d/observe/evaluate.py). That is the mean token loss over exactly the
validation windows, as one process computes it, in every layout (a mean of micro-batch means
would weigh the tokens of a partial micro-batch more, and count the padding).

The reductions are the training loss's (vocabulary-parallel over tp: ``_chunk_softmax`` of
parallel/tensor/loss.py), run ``train.loss_chunk_tokens`` rows at a time on the logits the
model returned, or on logits formed from the hidden states through the head where the head runs
in the loss. There is no gradient: nothing is saved, and no more than one chunk's fp32 logits
exist beside what the forward holds. A padding target (negative) lies in no rank's vocabulary
slice, so its rows go through the same collectives on every tp rank and are dropped from the sum.
"""

from typing import Callable

import torch
from torch import nn

from trainer3d.model.transformer import token_rows
from trainer3d.parallel.tensor.loss import _chunk_softmax, head_rows, vocab_range
from trainer3d.parallel.topology import ParallelDims


@torch.no_grad()
def _summed(logits_of: Callable[[int, int], torch.Tensor], targets: torch.Tensor, start: int, group,
            chunk: int) -> torch.Tensor:
    """Sum (fp32) of the token losses over ``targets`` >= 0; ``logits_of(a, b)``: rows a..b-1's
    (rows, valid) logits of this rank's vocabulary slice."""
    total = torch.zeros((), device=targets.device)
    for r0 in range(0, targets.shape[0], chunk):
        t = targets[r0:r0 + chunk]
        logits = logits_of(r0, r0 + t.shape[0])
        exp = torch.empty(logits.shape, device=logits.device)  # fp32, as the training loss's
        _, sum_exp, target_z, _, _ = _chunk_softmax(logits, exp, t - start, group)
        total += torch.where(t >= 0, sum_exp.log() - target_z, 0.0).sum()
    return total


def logits_loss_sum(local_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, dims: ParallelDims,
                    chunk: int) -> torch.Tensor:
    """The token losses' sum over the counted ``targets`` (batch, seq) of ``local_logits``
    (batch, seq, local vocab; the whole vocabulary when tp = 1)."""
    start, local, valid = vocab_range(vocab_size, dims.tp, dims.tp_rank)
    if local_logits.shape[-1] != local:
        raise ValueError(f"local logits have {local_logits.shape[-1]} columns, expected {local} "
                         f"(vocabulary {vocab_size} padded over tp={dims.tp})")
    rows, row_targets = token_rows(local_logits, targets)
    group = dims.tp_group if dims.tp > 1 else None
    return _summed(lambda a, b: rows[a:b, :valid], row_targets, start, group, chunk)


def head_loss_sum(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, vocab_size: int,
                  dims: ParallelDims, chunk: int) -> torch.Tensor:
    """The token losses' sum over the counted ``targets`` of ``head`` applied to the last
    stage's ``hidden`` (parallel/tensor/loss.py ``head_rows``)."""
    rows, weight, row_targets, start, valid, group = head_rows(hidden, head, targets, vocab_size, dims)
    w = weight[:valid]
    return _summed(lambda a, b: torch.mm(rows[a:b], w.t()), row_targets, start, group, chunk)
