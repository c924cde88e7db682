"""ZeRO-2/3 with the optimizer offloaded (``parallel.offload_optimizer``, pp = 1): FSDP2's
``CPUOffloadPolicy`` (torch/distributed/fsdp/_fully_shard/_fsdp_api.py) on every unit.

What lives where, per rank (parallel/zero/fsdp.py shards the same way without offload):

- host (pinned on CUDA): the fp32 parameter shard (the master weights), its gradient, and
  so the AdamW moments and step counter, which the optimizer allocates beside the shards;
- device: only what is in flight — a unit's shard copied up before its all-gather, the
  gathered compute-dtype parameters (stage 3: the unit running and the one prefetched;
  stage 2: all of them from forward to the end of backward, as without offload), the
  unsharded gradients until their reduce-scatter, the scattered shard until its copy down.

FSDP2 copies each unit's shard host-to-device as it gathers it and each reduce-scattered
gradient device-to-host in backward (non-blocking into pinned memory on the first
micro-batch; a later micro-batch's copy blocks, because the host adds it into the gradient
it accumulates), and waits for the copies at the end of backward. The step is then AdamW on
the host shards: the same fused kernel as without offload, on the CPU (``torch._fused_adamw_``,
vectorised and split over the cores: trainer3d/parallel/zero/offload.py measures it).

The global norm is reduced on the device as everywhere else (its all-reduce is a device
collective): the host shards' sum of squares goes up, the clip coefficient and fp16's
inverse loss scale come back as one divisor the kernel applies, fp16's overflow flag as its
skip flag (parallel/zero/host_scalars.py); fp16 gradients stay scaled until then.

On CPU ranks the policy moves nothing (host and device are one memory): the same code runs,
which is what the multi-rank tests check against the 1-rank model; the CUDA path is checked
by tests/gpu/test_offload_gpu.py. Checkpoints are the same tensors under the same keys as
without offload (``checkpoint_views`` of the shards), so runs resume across it both ways.
"""

from typing import List

import torch
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.optim.adamw import adamw_update_
from trainer3d.parallel.clip import sum_of_squares
from trainer3d.parallel.topology import ParallelDims
from trainer3d.parallel.zero.fsdp import FSDPOptimizer
from trainer3d.parallel.zero.host_scalars import HostScalars, clip_divisor

HOST = torch.device("cpu")


class OffloadedFSDPOptimizer(FSDPOptimizer):
    """ZeRO-2/3 over FSDP2 with the shards, their gradients and AdamW on the host."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        super().__init__(chunks, cfg, dims)
        self._divisor = None
        """This step's divisor of the gradients (a device scalar; None: nothing to divide)."""
        self._scalars = HostScalars(dims.device)

    def reduce_gradients(self) -> None:
        """Nothing left: FSDP reduce-scattered every micro-batch in backward and waited for the
        copies to the host at its end; fp16 gradients stay scaled (the host step divides)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = self._local_grads()
        local_sq = sum_of_squares([g for g, c in zip(grads, self.counted) if c], HOST).to(self.dims.device)
        norm, self._divisor = clip_divisor(local_sq, max_norm, self.scaler)
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        grad_scale, found_inf = self._scalars.fetch(self._divisor, self.scaler)
        adamw_update_(self.local, self._local_grads(), self.exp_avg, self.exp_avg_sq, self.decay,
                      self.step_count, lr, self.cfg.optim, found_inf, grad_scale)
        if self.scaler is not None:
            self.scaler.update()

    def host_tensors(self) -> List[torch.Tensor]:
        """What lives in host memory: the parameter shards, their gradients, the moments and the
        step counter (the accounting's ``host``: trainer3d/memory/states.py)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        return [*self.local, *grads, *self.exp_avg, *self.exp_avg_sq, self.step_count]
