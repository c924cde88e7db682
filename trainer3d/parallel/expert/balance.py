"""aux_free balancing in a layout: every MoE block's routing bias updated from the global batch.

DeepSeek-V3 (Liu et al. 2024, arXiv:2412.19437, sec. 2.1.2) adjusts each expert's bias "at the
end of each step" by the load the expert took over the whole batch. A rank's blocks count the
experts their own tokens went to (``MoE.step_counts``, the step's micro-batches); the global
batch's counts of a block are the sum over the ranks that hold different tokens of it:

- data and context parallelism: the dp x cp group (each rank its own micro-batches or chunks);
- sequence parallelism: the tp group too (each tp rank routes its shard of the sequence);
  without it every tp rank routes all the micro-batch's tokens, so the tp ranks hold the
  same counts and are not summed;
- pipeline parallelism: a block lives on one stage, whose dp x cp (x tp) ranks sum it.

Every rank of those groups then applies the same update to the same bias, so the bias stays
replicated without being communicated itself. One all-reduce per group per step, of
(MoE blocks of this rank) x num_experts int64 counts; exact, whatever the order.
"""

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.init import canonical_name
from trainer3d.model.moe import moe_blocks
from trainer3d.parallel.topology import ParallelDims


class AuxFreeBias:
    """The bias update of this rank's MoE blocks (``update`` after each applied optimizer step)."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        self.blocks = moe_blocks(chunks)
        self.groups = []
        if dims.dp_cp > 1:
            self.groups.append(dims.dp_cp_group)
        if cfg.parallel.sequence_parallel and dims.tp > 1:
            self.groups.append(dims.tp_group)

    def global_counts(self) -> torch.Tensor:
        """(blocks, experts) tokens routed to each expert over the global batch of the step."""
        counts = torch.stack([block.step_counts for block in self.blocks])
        for group in self.groups:
            dist.all_reduce(counts, group=group)
        return counts

    def update(self) -> None:
        """Move every block's bias by the step's global counts (``MoE.update_bias``). Reads the
        counts without taking them: the routing metrics take them after (observe/moe.py)."""
        if not self.blocks:
            return
        for block, counts in zip(self.blocks, self.global_counts()):
            block.update_bias(counts)


def moe_buffers(chunks: List[nn.Module]) -> Dict[str, torch.Tensor]:
    """The routing biases of this rank's blocks by their 1-rank name, which a checkpoint saves
    and loads (checkpoint/state.py): a resume routes as the run it resumes would have."""
    return {canonical_name(name): buffer for chunk in chunks for name, buffer in chunk.named_buffers()
            if name.endswith("expert_bias")}


def aux_free_bias(chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
    """The updater where ``model.moe.balance=aux_free``, else None."""
    moe = cfg.model.moe
    return AuxFreeBias(chunks, cfg, dims) if moe.num_experts and moe.balance == "aux_free" else None
