"""The routing metrics of the MoE blocks (docs/moe.md): per-expert token counts, the balance
loss, the max/mean load, per step.

Each step's counts and balance losses stay on the device (``record_step``); ``read`` (at the
logging interval, on every rank) sums them over the world in one all-reduce, each micro-batch's
tokens counted once: every rank of a dp or cp group holds its own tokens, tensor-parallel ranks
hold the same ones (all of them, or under sequence parallelism each its shard), and a pipeline
stage its own layers.
"""

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.moe import MoE, moe_layer
from trainer3d.parallel.topology import ParallelDims


def _layer_blocks(chunks: List[nn.Module]) -> Dict[int, MoE]:
    """This rank's MoE blocks by their layer's global index (``layers.{i}.feed_forward``)."""
    return {int(name): block.feed_forward for chunk in chunks for name, block in chunk.layers.items()
            if isinstance(block.feed_forward, MoE)}


class MoEStats:
    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        self.blocks = _layer_blocks(chunks)
        self.device = dims.device
        self.experts = cfg.model.moe.num_experts
        # Micro-batches per step over the world: dp x grad_accum. A micro-batch's cp ranks (and
        # tp ranks under sequence parallelism) each hold a share of its balance loss, computed over
        # their own tokens, which the all-reduce adds up (parallel/expert/tokens.py).
        self.micro_batches = dims.dp * cfg.train.grad_accum_steps
        # Every MoE layer's index, the same list on every rank (the all-reduce's rows).
        self.layers = [i for i in range(cfg.model.n_layers) if moe_layer(cfg.model, i)]
        self.counted = dims.tp_rank == 0 or cfg.parallel.sequence_parallel
        self._steps: List[torch.Tensor] = []

    def record_step(self) -> None:
        """Take this step's counts and balance losses from the blocks (no sync)."""
        row = torch.zeros(len(self.layers), self.experts + 1, device=self.device)
        for i, layer in enumerate(self.layers):
            block = self.blocks.get(layer)
            counts, aux = block.take_counts() if block is not None else (None, None)
            if counts is not None and self.counted:
                row[i, :self.experts] = counts
            if aux is not None and self.counted:
                row[i, self.experts] = aux
        self._steps.append(row)

    def read(self) -> Dict[str, List[float]]:
        """The steps' columns since the last read (every rank calls it: one all-reduce)."""
        if not self._steps:
            return {}
        packed = torch.stack(self._steps)  # (steps, layers, experts + 1)
        self._steps = []
        dist.all_reduce(packed)
        counts, aux = packed[..., :self.experts], packed[..., self.experts]
        load = counts.amax(-1) / counts.mean(-1).clamp(min=1e-9)
        columns = {"moe_aux_loss": (aux.mean(-1) / self.micro_batches).tolist(),
                   "moe_max_load": load.amax(-1).tolist()}
        for i, layer in enumerate(self.layers):
            for e in range(self.experts):
                columns[f"moe_tokens/L{layer}/E{e}"] = counts[:, i, e].tolist()
        return columns

