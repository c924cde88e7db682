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

A rank describes what it holds as pieces of those full tensors — the optimizer's
``checkpoint_views`` (trainer3d/parallel/zero/optimizer.py) name, for each parameter, a flat range
of its tp-local tensor and the tensors holding it; trainer3d/checkpoint/chunks.py turns a
TP shard, or a ZeRO flat range of one, into at most three rectangles — and
hands them to DCP as a DTensor whose local part is a ``LocalShardsWrapper`` of views into
its own storage, with each piece's offsets in the full tensor. DCP then writes each piece
once (replicas over dp and tp write the same pieces; DCP keeps one) and, on load, reads
into every rank's views exactly the regions it holds now — which is what makes a
checkpoint load into any other (tp, pp, dp, zero_stage): the stored tensors never depend
on the layout. Pipeline stages simply hold different names.

Only tensors go into the checkpoint (no pickled Python objects), so loading one never
unpickles anything; the step, the layout and the config go into the JSON marker.
"""

from typing import Dict, Sequence

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from trainer3d.checkpoint.chunks import full_shape, pieces
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.parallel.topology import ParallelDims


def _contiguous_stride(shape: Sequence[int]) -> Sequence[int]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


class PieceMaker:
    """Wraps views of this rank's storage as DTensors over a 1-D mesh of the whole world."""

    def __init__(self, dims: ParallelDims):
        self.mesh = init_device_mesh(dims.device.type, (dims.topo.world_size,))

    def __call__(self, flat: torch.Tensor, local_shape: Sequence[int], shard, start: int, end: int):
        """``flat`` holds elements [start, end) of the flattened local tensor of ``local_shape``;
        None when they are all padding."""
        pcs = pieces(local_shape, shard, start, end)
        if not pcs:
            return None
        views = [flat[p.flat_start - start:p.flat_start - start + p.numel].view(p.sizes) for p in pcs]
        shape = full_shape(local_shape, shard)
        wrapper = LocalShardsWrapper(views, [list(p.offsets) for p in pcs])
        return DTensor.from_local(wrapper, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))


def state_key(kind: str, name: str) -> str:
    """The checkpoint key of one kind of state of parameter ``name``."""
    return f"model.{name}" if kind == "param" else f"optim.{kind}.{name}"


def rank_state(optimizer: ZeroOptimizer, dims: ParallelDims, make: PieceMaker,
               with_rng: bool = True) -> Dict[str, object]:
    """The DCP state dict of this rank (views: saving reads them, loading writes into them)."""
    state: Dict[str, object] = {}
    for view in optimizer.checkpoint_views():
        for kind, tensor in view.tensors.items():
            piece = make(tensor, view.local_shape, view.tp_shard, view.start, view.end)
            if piece is not None:
                state[state_key(kind, view.name)] = piece
    state["optim.step"] = optimizer.step_count
    if optimizer.scaler is not None:
        state.update({f"loss_scaler.{k}": t for k, t in optimizer.scaler.persistent().items()})
    if with_rng:
        state[f"rng.rank{dims.rank}"] = torch.get_rng_state()
    return state


def after_load(optimizer: ZeroOptimizer, state: Dict[str, object], dims: ParallelDims, with_rng: bool) -> None:
    """Put what DCP loaded into its place where it could not be loaded in place."""
    optimizer.after_load()
    if with_rng:
        torch.set_rng_state(state[f"rng.rank{dims.rank}"])
