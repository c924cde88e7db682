"""ZeRO stages 2 and 3 through FSDP2 (``fully_shard``), for pp == 1 only.

Every transformer block and then the root module are sharded over the dp sub-mesh
(``dims.fsdp_mesh()``, dp x cp): each rank keeps dim-0 slice ``zero_shard_rank`` of every parameter, in
fp32 (the master weights), with its gradient and AdamW moments for that slice alone.

Hybrid sharding (``parallel.dp_shard`` = S < dp): the mesh is 2-D, (dp_replicate, dp_shard),
and ``fully_shard`` shards over its last dimension and replicates over the first
(torch/distributed/fsdp/_fully_shard/_fully_shard.py: "If the mesh is 2D, then parameters are
sharded across the 1st dim and replicated across the 0th dim"; torchtitan's
``dp_replicate`` x ``dp_shard`` mesh). Each micro-batch's gradients are reduce-scattered
inside the shard group and the shard then all-reduced over the replicas, both averaging, so
the gradient is the mean over dp x cp as with full sharding.

- Stage 3 (P_os+g+p): ``reshard_after_forward=True`` — a block's full parameters exist only
  while it runs, all-gathered again for backward.
- Stage 2 (P_os+g): ``reshard_after_forward=False`` — the full (compute-dtype) parameters
  stay from forward until the end of backward, as ZeRO-2 keeps parameters replicated.

The model is sharded while still on the meta device and only then materialised
(``shard_and_materialise``, called by trainer3d/parallel/parallelize.py's
``build_model_chunks``): each rank allocates its own shards and asks the parameter source
for their rows alone, so no rank ever holds the whole fp32 model, and the values are the
1-rank model's (the layout-independent init, trainer3d/model/init.py) — torchtitan does the
same: meta-device ``fully_shard``, ``to_empty``, then ``init_weights`` on the shards
(torchtitan/train.py).

Gradients are reduce-scattered in fp32 after every micro-batch's backward and summed into
the sharded gradient, so no rank ever holds the full gradient (FSDP's default; skipping the
sync on early micro-batches would keep an unsharded one). bf16/fp16 compute through
``MixedPrecisionPolicy(param_dtype=...)``: the model is built in fp32 for these stages
(``precision.param_dtype``), so the sharded fp32 parameters — the master weights — start
from the exact initial values, not from their rounding to ``train.dtype``. The update is the same fused AdamW kernel as stages
0/1, run on the local shards; fp16 loss scaling and the global-norm clip as there.

Tensor parallelism composes: FSDP shards each rank's tp slice over the dp sub-mesh, and
since ``fully_shard`` replaces the parameters (dropping their tensor-parallel marks), the
marks are put back on the sharded parameters: the global norm counts tp-replicated
parameters once, the sequence-parallel sync finds the replicated norm weights, and the
checkpoint places each shard in the full tensor. The tp ranks of one dp rank hold the
same rows of a replicated parameter, so summing their gradient shards over tp
(trainer3d/parallel/tensor/layers.py) sums the same elements.
"""

import math
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.init import ParameterSource, canonical_name, full_shape, mark_tp_shard, tp_shard_of
from trainer3d.optim.schedule import decays
from trainer3d.optim.adamw import adamw_update_
from trainer3d.parallel.clip import clip_by_global_norm_, counted_once_over_tp, sum_of_squares
from trainer3d.parallel.zero.optimizer import StateView, ZeroOptimizer
from trainer3d.optim.mixed_precision import DTYPES, make_loss_scaler
from trainer3d.parallel.topology import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.fsdp import OffloadPolicy


def offload_policy(cfg: Config, dims: ParallelDims) -> "OffloadPolicy":
    """``parallel.offload_optimizer``: FSDP2 keeps the sharded parameters, their gradients (and
    so the optimizer, which allocates its state like them) in host memory, pinned on CUDA
    (parallel/zero/fsdp_offload.py). On CPU ranks host and device are one memory and the policy
    moves nothing; the same code path runs."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy  # lazy: see shard_model

    if cfg.parallel.offload_optimizer:
        return CPUOffloadPolicy(pin_memory=dims.device.type == "cuda")
    return OffloadPolicy()


def shard_model(model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
    """fp32 master parameters sharded over dp; compute in ``train.dtype``; tp marks kept."""
    # Here, not at the top: torch.distributed.fsdp imports DTensor and sympy (about a second of
    # CPU), which only ZeRO-2/3 uses; every rank, the launcher and the planner import this module.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    marks = {name: tp_shard_of(p) for name, p in model.named_parameters()}
    compute = DTYPES[cfg.train.dtype]
    policy = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                                  reduce_dtype=torch.float32)
    reshard = cfg.parallel.zero_stage == 3
    mesh = dims.fsdp_mesh()
    offload = offload_policy(cfg, dims)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    # The root (embedding, final norm, head) stays gathered from forward to backward when the
    # loss applies the head after the model's forward (``train.loss_chunk_tokens``: it reads
    # the head's weight then, and saves gradients computed from it); backward starts with the
    # root anyway, so the gathered root is what stage 3 all-gathers again at once otherwise.
    root_reshard = reshard and cfg.train.loss_chunk_tokens == 0
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=policy, offload_policy=offload)
    for name, p in model.named_parameters():
        shard = marks[name]
        if shard is not None:
            mark_tp_shard(p, shard.dim, shard.rank, shard.size, shard.full)


def dp_rows(rows: int, dims: ParallelDims) -> Tuple[int, int]:
    """[start, stop) of the dim-0 rows this rank's FSDP2 shard holds: ``torch.chunk`` over the
    n = ``zero_shards`` ranks of its shard group, ceil(rows / n) rows a rank, the last ranks fewer or none."""
    per = -(-rows // dims.zero_shards)
    start = min(dims.zero_shard_rank * per, rows)
    return start, min(start + per, rows)


@torch.no_grad()
def fill_shards(model: nn.Module, source: Optional[ParameterSource], dims: ParallelDims) -> None:
    """Fill this rank's shard of every parameter from ``source`` (its rows alone), or zero
    it (``source`` None: a resumed run, the checkpoint fills them; the padded vocabulary's
    tail rows are in no checkpoint and stay zero)."""
    for name, param in model.named_parameters():
        local = param.to_local()  # a view of the shard's storage, which FSDP all-gathers
        if source is None:
            local.zero_()
            continue
        shard = tp_shard_of(param)
        rows = dp_rows(param.shape[0], dims)
        values = source(canonical_name(name), full_shape(param.shape, shard), shard, rows)
        if tuple(values.shape) != tuple(local.shape):
            raise ValueError(f"{canonical_name(name)}: the source gave shape {tuple(values.shape)} for rows {rows}, "
                             f"this rank's shard is {tuple(local.shape)}")
        local.copy_(values.to(dtype=local.dtype))  # host to device where the shard is on the device


def shard_and_materialise(model: nn.Module, cfg: Config, dims: ParallelDims,
                          source: Optional[ParameterSource], device: torch.device) -> None:
    """Shard the meta-device ``model`` (fp32), allocate this rank's shards on ``device`` and
    fill them: the rank's memory grows by its shards alone (tests/multirank/test_zero3_init.py)."""
    if dims.pp != 1:
        raise ValueError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs parallel.pp=1")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("FSDP keeps the fp32 master weights as its parameters: build the model in fp32")
    shard_model(model, cfg, dims)
    model.to_empty(device=device)  # FSDPModule._apply re-pads each local shard (torch/distributed/fsdp)
    fill_shards(model, source, dims)


class FSDPOptimizer(ZeroOptimizer):
    """ZeRO-2/3: the optimizer contract over an FSDP2-sharded model."""

    shards_state = True

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        if len(chunks) != 1 or dims.pp != 1:
            raise ValueError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs parallel.pp=1")
        from torch.distributed.fsdp import FSDPModule  # lazy: see shard_model

        if not isinstance(chunks[0], FSDPModule):
            raise ValueError("ZeRO-2/3 shards the model as it is built: build it with "
                             "trainer3d.parallel.parallelize.build_model_chunks")
        self.cfg, self.dims = cfg, dims
        model = chunks[0]
        self.named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        with torch.no_grad():
            self.local = [p.to_local() for p in self.params]  # views of the sharded fp32 storage
        self.exp_avg = [torch.zeros_like(t) for t in self.local]
        self.exp_avg_sq = [torch.zeros_like(t) for t in self.local]
        # beside the shards, where the kernel wants it: the device, or the host when offloaded
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.local[0].device)
        self.decay = [decays(n, p) for n, p in self.named]
        # HSDP's replicas hold the same gradient shards: the norm counts the first replica's
        self.counted = [counted_once_over_tp(p, dims) and dims.dp_replicate_rank == 0 for p in self.params]
        self.scaler = make_loss_scaler(DTYPES[cfg.train.dtype], dims.device, cfg.train.loss_scale_init)

    def _local_grads(self) -> List[torch.Tensor]:
        return [p.grad.to_local() if p.grad is not None else torch.zeros_like(t)
                for p, t in zip(self.params, self.local)]

    def parameters(self) -> List[nn.Parameter]:
        return self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def reduce_gradients(self) -> None:
        """FSDP reduce-scattered every micro-batch inside backward; fp16: unscale the shards."""
        if self.scaler is not None:
            torch._foreach_mul_(self._local_grads(), self.scaler.inv_scale())

    def grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's dp shard of ``param``'s gradient (None before any backward)."""
        return param.grad.to_local() if param.grad is not None else None

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

    def checkpoint_views(self) -> List[StateView]:
        """Per parameter: the flat range of its (tp-local) tensor this rank's shard covers
        (``dp_rows``), with views of the shard — the fp32 parameters are the master weights —
        and of its moments. HSDP's replicas describe the same pieces; DCP writes one of each."""
        out = []
        for (name, param), local, a, b in zip(self.named, self.local, self.exp_avg, self.exp_avg_sq):
            lo = dp_rows(param.shape[0], self.dims)[0] * math.prod(param.shape[1:])
            out.append(StateView(name, tuple(param.shape), tp_shard_of(param), lo, lo + local.numel(),
                                 {"param": local.view(-1), "exp_avg": a.view(-1), "exp_avg_sq": b.view(-1)}))
        return out

    def after_load(self) -> None:
        """Nothing to derive: the loaded fp32 shards are what FSDP gathers (and casts) next."""

    def state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        return {"params": list(self.local), "grads": [p.grad.to_local() for p in self.params if p.grad is not None],
                "master": [], "optimizer": [*self.exp_avg, *self.exp_avg_sq, *self._scalar_tensors()]}
