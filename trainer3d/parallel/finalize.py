"""Finalize the gradients: everything between the last backward and clipping, in one place.

After the step's micro-batches, a rank's gradients are not yet the gradients of the
one-process model: they must be reduced over dp, summed over tp for parameters replicated
in a sequence-parallel region, and summed between the two copies of a tied embedding that
a pipeline keeps on its first and last stages. ``GradFinalizer`` runs the three in that order
(Megatron-LM's ``finalize_model_grads`` in megatron/core/distributed/finalize_model_grads.py
is the same seam). Which of them apply is decided once, when it is built; a step pays only
for what its layout needs.

The sums work on what the optimizer steps from (``optimizer.grad(param)``: the whole
dp-reduced gradient for ZeRO 0/1, this rank's dp shard under FSDP), so fp16's unscaling and
ZeRO-1's ownership hold.
"""

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.model.init import split_over_tp
from trainer3d.parallel.tied import TiedEmbedding
from trainer3d.parallel.topology import ParallelDims
from trainer3d.parallel.zero.optimizer import ZeroOptimizer


class GradFinalizer:
    """``finalize()`` after backward, before ``optimizer.clip_grad_norm``; every rank calls it."""

    def __init__(self, chunks: List[nn.Module], optimizer: ZeroOptimizer, dims: ParallelDims,
                 sequence_parallel: bool):
        self.optimizer, self.dims = optimizer, dims
        # Under sequence parallelism every tp-replicated parameter (the norms) lives in a
        # sequence-sharded region: each tp rank's gradient covers only its tokens (an ep rank's
        # experts too: whole on every tp rank, fed by that tp rank's tokens).
        self.replicated: List[nn.Parameter] = []
        if sequence_parallel and dims.tp > 1:
            self.replicated = [p for p in optimizer.parameters() if not split_over_tp(p)]
        self.tied: Optional[TiedEmbedding] = TiedEmbedding.find(chunks, optimizer, dims)

    def finalize(self) -> None:
        self.optimizer.reduce_gradients()
        if self.replicated:
            self._sum_replicated_over_tp()
        if self.tied is not None:
            self.tied.sum_gradients()
        changed = self.replicated + ([self.tied.param] if self.tied is not None else [])
        if changed:
            self.optimizer.grads_changed(changed)

    def _sum_replicated_over_tp(self) -> None:
        """The tp sum of the replicated parameters' gradients (one flat all-reduce): the full
        gradient, after which every tp rank holds the same one and the replicas stay equal
        (Korthikanti et al. 2022, sec. 4.2.2)."""
        grads = [g for g in (self.optimizer.grad(p) for p in self.replicated) if g is not None]
        if not grads:
            return
        # ZeRO-2/3 offloaded (parallel/zero/fsdp_offload.py): the shards are host tensors, and the
        # collective runs on the device (NCCL takes device tensors only); a no-op otherwise
        flat = torch._utils._flatten_dense_tensors(grads).to(self.dims.device)
        dist.all_reduce(flat, group=self.dims.tp_group)
        for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)
