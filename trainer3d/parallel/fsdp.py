"""ZeRO stages 2 and 3 through FSDP2 (``fully_shard``), for pp == 1 only.

Every transformer block and then the root module are sharded over the dp sub-mesh
(``dims.mesh["dp"]``): each rank keeps dim-0 slice ``dp_rank`` of every parameter, in fp32
(the master weights), with its gradient and AdamW moments for that slice alone.

- Stage 3 (P_os+g+p): ``reshard_after_forward=True`` — a block's full parameters exist only
  while it runs, all-gathered again for backward.
- Stage 2 (P_os+g): ``reshard_after_forward=False`` — the full (compute-dtype) parameters
  stay from forward until the end of backward, as ZeRO-2 keeps parameters replicated.

Gradients are reduce-scattered in fp32 after every micro-batch's backward and summed into
the sharded gradient, so no rank ever holds the full gradient (FSDP's default; skipping the
sync on early micro-batches would keep an unsharded one). bf16/fp16 compute through
``MixedPrecisionPolicy(param_dtype=...)``. The update is the same fused AdamW kernel as
stages 0/1, run on the local shards; fp16 loss scaling and the global-norm clip as there.
"""

import math
from typing import Dict, List

import torch
from torch import nn

from trainer3d.config import Config
from trainer3d.model.init import canonical_name, tp_shard_of
from trainer3d.optim import decays
from trainer3d.parallel.adamw import adamw_update_
from trainer3d.parallel.clip import clip_by_global_norm_, sum_of_squares
from trainer3d.parallel.precision import make_loss_scaler
from trainer3d.topology import ParallelDims


def shard_model(model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
    """fp32 master parameters sharded over dp; compute in ``train.dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.dtype]
    model.float()  # build_model_chunks cast to train.dtype; FSDP keeps fp32 masters and casts itself
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    reshard = cfg.parallel.zero_stage == 3
    mesh = dims.mesh["dp"]
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


class FSDPOptimizer:
    """ZeRO-2/3: the optimizer interface over an FSDP2-sharded model."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        from trainer3d.parallel.zero import counted_once_over_tp

        if len(chunks) != 1 or dims.pp != 1:
            raise ValueError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs parallel.pp=1")
        self.cfg, self.dims = cfg, dims
        model = chunks[0]
        before = {canonical_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        counted = {n: counted_once_over_tp(p, dims) for n, p in before.items()}  # tp_shard is lost by sharding
        self.tp_shards = {n: tp_shard_of(p) for n, p in before.items()}
        decay = {n: decays(n, p) for n, p in before.items()}
        dtype = before[next(iter(before))].dtype
        shard_model(model, cfg, dims)
        self.named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        with torch.no_grad():
            self.local = [p.to_local() for p in self.params]  # views of the sharded fp32 storage
        self.exp_avg = [torch.zeros_like(t) for t in self.local]
        self.exp_avg_sq = [torch.zeros_like(t) for t in self.local]
        self.step_count = torch.zeros((), dtype=torch.float32, device=dims.device)
        self.decay = [decay[n] for n, _ in self.named]
        self.counted = [counted[n] for n, _ in self.named]
        self.scaler = make_loss_scaler(dtype, dims.device, cfg.train.loss_scale_init)

    def _local_grads(self) -> List[torch.Tensor]:
        return [p.grad.to_local() if p.grad is not None else torch.zeros_like(t)
                for p, t in zip(self.params, self.local)]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def reduce_gradients(self) -> None:
        """FSDP reduce-scattered every micro-batch inside backward; fp16: unscale the shards."""
        if self.scaler is not None:
            torch._foreach_mul_(self._local_grads(), self.scaler.inv_scale())

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        return param.grad

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = self._local_grads()
        local_sq = sum_of_squares([g for g, c in zip(grads, self.counted) if c], self.dims.device)
        norm = clip_by_global_norm_(local_sq, grads, max_norm)
        if self.scaler is not None:
            self.scaler.check(norm)
        return norm

    def step(self, lr: float) -> None:
        found_inf = self.scaler.found_inf if self.scaler is not None else None
        adamw_update_(self.local, self._local_grads(), self.exp_avg, self.exp_avg_sq, self.decay,
                      self.step_count, lr, self.cfg.optim, found_inf)
        if self.scaler is not None:
            self.scaler.update()

    def step_metrics(self) -> Dict[str, torch.Tensor]:
        return self.scaler.metrics() if self.scaler is not None else {}

    def owned(self) -> List[dict]:
        """Per parameter: the flat range of its (tp-local) tensor this rank's shard covers
        (FSDP2 gives rank r rows [r*ceil(rows/dp), ...)), and views of the shard, its moments
        (the fp32 parameters are the master weights): what a resharding checkpoint needs."""
        out = []
        for (name, param), local, a, b in zip(self.named, self.local, self.exp_avg, self.exp_avg_sq):
            rows, per_row = param.shape[0], math.prod(param.shape[1:])
            first = min(self.dims.dp_rank * -(-rows // self.dims.dp), rows)
            lo = first * per_row
            out.append({"name": name, "tp_shard": self.tp_shards[name], "range": (lo, lo + local.numel()),
                        "param": local.view(-1), "master": None, "exp_avg": a.view(-1), "exp_avg_sq": b.view(-1)})
        return out

    def state_dict(self) -> dict:
        state = {"step": self.step_count.clone(),
                 "exp_avg": {n: t.clone() for (n, _), t in zip(self.named, self.exp_avg)},
                 "exp_avg_sq": {n: t.clone() for (n, _), t in zip(self.named, self.exp_avg_sq)}}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for (n, _), a, b in zip(self.named, self.exp_avg, self.exp_avg_sq):
            a.copy_(state["exp_avg"][n])
            b.copy_(state["exp_avg_sq"][n])
        self.step_count.copy_(state["step"])
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
