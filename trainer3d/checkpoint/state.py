"""This rank's part of a checkpoint, as a torch.distributed.checkpoint (DCP) state dict.

Every tensor is stored under its 1-rank name in its full logical shape (vocabulary
unpadded), whatever the layout that wrote it:

    model.<name>                  parameters
    optim.exp_avg.<name>          AdamW moments (fp32)
    optim.exp_avg_sq.<name>
    optim.master.<name>           fp32 master weights (bf16/fp16 training only)
    optim.step, loss_scaler.*     scalars, the same on every rank
    rng.rank<r>                   each rank's torch generator state (restored only when the
                                  world size is unchanged; training draws no random numbers,
                                  so this is for the record and for user code)

A rank describes what it holds as pieces of those full tensors (trainer3d/checkpoint/
chunks.py: a TP shard, or a ZeRO-1 flat range of one, is at most three rectangles) and
hands them to DCP as a DTensor whose local part is a ``LocalShardsWrapper`` of views into
its own storage, with each piece's offsets in the full tensor. DCP then writes each piece
once (replicas over dp and tp write the same pieces; DCP keeps one) and, on load, reads
into every rank's views exactly the regions it holds now — which is what makes a
checkpoint load into any other (tp, pp, dp, zero_stage): the stored tensors never depend
on the layout. Pipeline stages simply hold different names.

Only tensors go into the checkpoint (no pickled Python objects), so loading one never
unpickles anything; the step, the layout and the config go into the JSON marker.
"""

from typing import Dict, List, Sequence

import torch
from torch import nn

from trainer3d.checkpoint.chunks import full_shape, pieces
from trainer3d.model.init import canonical_name, tp_shard_of
from trainer3d.topology import ParallelDims


def _contiguous_stride(shape: Sequence[int]) -> Sequence[int]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


class PieceMaker:
    """Wraps views of this rank's storage as DTensors over a 1-D mesh of the whole world."""

    def __init__(self, dims: ParallelDims):
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(dims.device.type, (dims.topo.world_size,))

    def __call__(self, flat: torch.Tensor, local_shape: Sequence[int], shard, start: int, end: int):
        """``flat`` holds elements [start, end) of the flattened local tensor of ``local_shape``;
        None when they are all padding."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

        pcs = pieces(local_shape, shard, start, end)
        if not pcs:
            return None
        views = [flat[p.flat_start - start:p.flat_start - start + p.numel].view(p.sizes) for p in pcs]
        shape = full_shape(local_shape, shard)
        wrapper = LocalShardsWrapper(views, [list(p.offsets) for p in pcs])
        return DTensor.from_local(wrapper, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))


def parameters_by_name(chunks: List[nn.Module]) -> Dict[str, nn.Parameter]:
    return {canonical_name(n): p for chunk in chunks for n, p in chunk.named_parameters()}


def rank_state(chunks: List[nn.Module], optimizer, dims: ParallelDims, make: PieceMaker,
               with_rng: bool = True) -> Dict[str, object]:
    """The DCP state dict of this rank (views: saving reads them, loading writes into them)."""
    state: Dict[str, object] = {}
    params = parameters_by_name(chunks)
    owned = optimizer.owned()
    sharded_params = all("param" in o for o in owned)  # FSDP (stages 2/3): parameters are shards too
    # fp32 training keeps no separate master copy (the parameters are the master weights).
    has_master = getattr(getattr(optimizer, "adam", None), "master", None) is not None
    if not sharded_params:
        for name, p in params.items():
            local = p.detach()
            piece = make(local.view(-1), local.shape, tp_shard_of(p), 0, local.numel())
            if piece is not None:
                state[f"model.{name}"] = piece
    for o in owned:
        p = params[o["name"]]
        lo, hi = o["range"]
        kinds = ("param", "exp_avg", "exp_avg_sq", "master") if sharded_params else ("exp_avg", "exp_avg_sq", "master")
        for kind in kinds:
            if o.get(kind) is None or (kind == "master" and not has_master):
                continue
            piece = make(o[kind], p.shape, o["tp_shard"], lo, hi)
            if piece is not None:
                state[f"model.{o['name']}" if kind == "param" else f"optim.{kind}.{o['name']}"] = piece
    state["optim.step"] = optimizer.step_count
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None:
        state["loss_scaler.scale"], state["loss_scaler.growth_tracker"] = scaler.scale, scaler.growth_tracker
    if with_rng:
        state[f"rng.rank{dims.rank}"] = torch.get_rng_state()
    return state


def after_load(optimizer, state: Dict[str, object], dims: ParallelDims, with_rng: bool) -> None:
    """Put what DCP loaded into its place where it could not be loaded in place."""
    adam = getattr(optimizer, "adam", None)
    if adam is not None and adam.master is not None:  # mixed precision: params := master (cast)
        torch._foreach_copy_(adam.param_views, adam.master_views)
    if with_rng:
        torch.set_rng_state(state[f"rng.rank{dims.rank}"])
    if adam is not None and adam.master is not None and optimizer.sharded and dims.dp > 1:
        optimizer._all_gather_params()  # every dp rank's full flat parameters from the owners' masters

