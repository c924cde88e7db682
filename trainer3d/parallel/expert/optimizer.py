"""The optimizer of an expert-parallel layout: two flat ZeRO 0/1 optimizers behind one contract.

The dense parameters (attention, norms, routers, shared experts, embedding, head) are
replicated over dp x cp, as in every layout; an ep rank's slice of the routed experts is
replicated over its expert-dp group only (dp x cp / ep ranks, parallel/topology.py). Each set
gets its own flat buffers, bucketed reduction and (ZeRO-1) shards over its own group
(parallel/zero/flat.py with a ``ReplicaGroup``), as Megatron-Core keeps separate buffers for
expert parameters over its expert-data-parallel group
(megatron/core/distributed/distributed_data_parallel.py, ``expert_parallel_buffers``).

The expert gradients' scale. The step's loss is the mean over the dp x cp ranks' losses,
L = (1 / N) sum_r L_r with N = dp x cp, so every parameter's gradient is (1 / N) sum_r dL_r.
A dense parameter sees dL_r on rank r alone, and the average over dp x cp is that. Expert e
lives on one rank of each ep group, and the combine's backward (parallel/expert/dispatch.py)
brings it the gradient of every token routed to it from its ep group: its local gradient is
sum over that ep group of dL_s. Summed over the expert-dp group it is sum_r dL_r over all N
ranks; the reducer averages over the expert-dp group (N / ep ranks), so one more factor 1 / ep
gives (1 / N) sum_r dL_r. The reducer multiplies each expert bucket by it as the bucket's
reduction is launched (``grad_factor``), so the gradients are right wherever they are read: on
the device, and in the copies an offloaded step takes to the host as each bucket is reduced.

The gradient norm adds both optimizers' shares before its one all-reduce over the world:
each expert element is counted once, by its ZeRO-1 owner in the expert-dp group (stage 0: by
expert-dp rank 0), on tp rank 0.

``parallel.offload_optimizer`` (ZeRO-Offload, parallel/zero/offload.py): both halves are
offloaded optimizers, each with its owned state on the host and stepped there by the same host
AdamW kernel; the one global norm gives one clip divisor, which both host steps apply as they
read their gradients.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.init import is_expert_shard
from trainer3d.parallel.clip import clip_by_global_norm_
from trainer3d.parallel.topology import ParallelDims
from trainer3d.parallel.zero.flat import FlatZeroOptimizer, ReplicaGroup
from trainer3d.parallel.zero.host_scalars import clip_divisor
from trainer3d.parallel.zero.offload import OffloadedOptimizer
from trainer3d.parallel.zero.optimizer import TERMS, StateView, ZeroOptimizer


class ExpertParallelOptimizer(ZeroOptimizer):
    """ZeRO stage 0 or 1 (``sharded``) of the dense parameters over dp x cp and of the
    expert slices over the expert-dp group, each offloaded to the host with
    ``parallel.offload_optimizer``."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims, sharded: bool):
        self.dims = dims
        self.shards_state = sharded
        self.offloaded = cfg.parallel.offload_optimizer
        part = OffloadedOptimizer if self.offloaded else FlatZeroOptimizer
        self.dense = part(chunks, cfg, dims, sharded, trains=lambda p: not is_expert_shard(p))
        self.experts = part(chunks, cfg, dims, sharded, trains=is_expert_shard,
                            replicas=ReplicaGroup(dims.expert_dp_group, dims.expert_dp, dims.expert_dp_rank),
                            grad_factor=1.0 / dims.ep)
        self.parts = (self.dense, self.experts)
        self.step_count = self.dense.step_count
        self.scaler = None  # validate() refuses fp16 with ep > 1 (config/validate_moe.py)
        self._owner: Dict[nn.Parameter, FlatZeroOptimizer] = {p: o for o in self.parts for p in o.names}

    def parameters(self) -> List[nn.Parameter]:
        return [p for o in self.parts for p in o.parameters()]

    def zero_grad(self) -> None:
        for o in self.parts:
            o.zero_grad()

    def reduce_gradients(self) -> None:
        for o in self.parts:
            o.reduce_gradients()

    def grads_changed(self, params: List[nn.Parameter]) -> None:
        for o in self.parts:  # each offloaded half sends again those of its own parameters
            o.grads_changed(params)

    def grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        return self._owner[param].grad(param)

    def owned_ranges(self, param: torch.Tensor) -> List[Tuple[int, int]]:
        return self._owner[param].owned_ranges(param)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        local_sq = self.dense.local_sum_of_squares() + self.experts.local_sum_of_squares()
        if self.offloaded:  # one divisor, applied by both host steps as they read their gradients
            norm, divisor = clip_divisor(local_sq, max_norm, None)
            for o in self.parts:
                o.divide_grads_by(divisor)
            return norm
        grads = self.dense.owned_grads() + self.experts.owned_grads()
        return clip_by_global_norm_(local_sq, grads, max_norm, self.dense.world)

    def step(self, lr: float) -> None:
        for o in self.parts:
            o.step(lr)

    def wait_params(self) -> None:
        for o in self.parts:
            o.wait_params()

    def checkpoint_views(self) -> List[StateView]:
        return [v for o in self.parts for v in o.checkpoint_views()]

    def after_load(self) -> None:
        # one step count is checkpointed (the dense one's); the experts' AdamW bias correction follows it
        self.experts.step_count.copy_(self.dense.step_count)
        for o in self.parts:
            o.after_load()

    def state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        out = {term: [] for term in TERMS}
        for o in self.parts:
            for term, tensors in o.state_tensors().items():
                out[term] += tensors
        return out
