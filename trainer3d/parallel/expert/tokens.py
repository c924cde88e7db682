"""The balance loss of a micro-batch's tokens, wherever the layout puts them.

An MoE block's aux and z losses are means over a micro-batch's tokens (model/moe.py). Where
each rank holds all of them (one process, data and pipeline parallelism, tensor parallelism
without sequence parallelism: every tp rank computes the block on the same tokens and gets
the same gradients), the block needs nothing. Where a micro-batch's tokens are split over
ranks, the block sums the expert counts over those ranks (f is the micro-batch's) and
computes its share of the loss over its own tokens:

- sequence parallelism: the tp group holds one sequence shard each; the router's and the
  experts' gradients (tp-replicated) are summed over tp (parallel/finalize.py), so the shares
  add up to the micro-batch's gradient;
- context parallelism: the cp group holds two chunks each; gradients are averaged over
  dp x cp (each cp rank's language-model loss is the mean of its own tokens), so a share
  starts backward cp times larger.
"""

from typing import List, Optional

import torch
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.moe import moe_blocks
from trainer3d.parallel.topology import ParallelDims


def apply_moe_layout(chunks: List[nn.Module], cfg: Config, dims: ParallelDims,
                     loss_scale: Optional[torch.Tensor] = None) -> None:
    """Give this rank's MoE blocks the groups their tokens are split over and the scale their
    losses' gradients start from (a micro-batch's loss is divided by grad_accum_steps:
    parallel/pipeline/losses.py's ``MicroBatchLoss``), and fp16's dynamic ``loss_scale``
    tensor, which ``MicroBatchLoss`` multiplies the loss by (None without fp16)."""
    groups, ranks = [], 1
    if cfg.parallel.sequence_parallel and dims.tp > 1:
        groups.append(dims.tp_group)
        ranks *= dims.tp
    if dims.cp > 1:
        groups.append(dims.cp_group)
        ranks *= dims.cp
    for block in moe_blocks(chunks):
        block.token_groups = groups
        block.token_ranks = ranks
        block.aux_grad_scale = dims.cp / cfg.train.grad_accum_steps
        block.loss_scale = loss_scale
