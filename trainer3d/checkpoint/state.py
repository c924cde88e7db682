"""This rank's part of a checkpoint, as a torch.distributed.checkpoint (DCP) state dict.

Every tensor is stored under its 1-rank name in its full logical shape (vocabulary
unpadded), whatever the layout that wrote it:

    model.<name>                  parameters
    optim.exp_avg.<name>          AdamW moments (fp32)
    optim.exp_avg_sq.<name>
    optim.master.<name>           fp32 master weights (bf16/fp16 training only)
    optim.step, loss_scaler.*     scalars, the same on every rank
    moe_bias.<name>               model.moe.balance=aux_free's routing bias of each MoE block
                                  (a buffer, replicated wherever its block is; model/moe.py)
    rng.rank<r>                   each rank's torch generator state (restored only when the
                                  world size is unchanged; training draws no random numbers,
                                  so this is for the record and for user code)

A rank describes what it holds as pieces of those full tensors — the optimizer's
``checkpoint_views`` (trainer3d/parallel/zero/optimizer.py) name, for each parameter, a flat range
of its tp-local tensor and the tensors holding it; trainer3d/checkpoint/chunks.py turns a
TP shard, or a ZeRO flat range of one, into at most three rectangles — and
hands them to DCP as a DTensor whose local part is a ``LocalShardsWrapper`` of views into
its own storage, with each piece's offsets in the full tensor. A piece's mesh is on the
device its tensor is on: the live state of an offloaded run is partly in host memory
(parallel/zero/offload.py, fsdp_offload.py), and ``DTensor.from_local`` copies a local
tensor to its mesh's device (torch/distributed/tensor/_api.py, ``from_local``) — a save
would then copy the host state onto the GPU, and a load would fill that copy and leave the
host tensors as they were. So pieces are made by the maker of their tensor's device.
DCP then writes each piece once (replicas over dp and tp write the same pieces; DCP keeps
one) and, on load, reads into every rank's views exactly the regions it holds now — which
is what makes a checkpoint load into any other (tp, pp, dp, zero_stage): the stored tensors
never depend on the layout. Pipeline stages simply hold different names.

Only tensors go into the checkpoint (no pickled Python objects), so loading one never
unpickles anything; the step, the layout and the config go into the JSON marker.
"""

from typing import Callable, Dict, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
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


BIAS = "moe_bias."
"""The key prefix of aux_free's routing biases."""

Stage = Callable[[str, torch.Tensor], torch.Tensor]
"""(state key, tensor) -> the host copy a save writes (trainer3d/checkpoint/staging.py)."""


class PieceMaker:
    """Wraps views of this rank's storage (or of its host copy) as DTensors over ``mesh``, a
    1-D mesh of the whole world on the device the tensors are on; refuses a tensor on
    another device type (``check_device``)."""

    def __init__(self, mesh: DeviceMesh, reuse: bool = False):
        self.mesh = mesh
        self.reuse = reuse
        """Keep each piece made and return it again for the same storage and region: for the
        staging buffers, which every background save refills in place (wrapping ~150 pieces
        as DTensors took half of a save's stall: tools/bench/checkpoint.py). A kept piece holds
        its storage alive, so no other tensor can take its address while it is kept."""
        self._made: Dict[tuple, object] = {}

    def __call__(self, flat: torch.Tensor, local_shape: Sequence[int], shard, start: int, end: int):
        """``flat`` holds elements [start, end) of the flattened local tensor of ``local_shape``;
        None when they are all padding."""
        check_device(flat, self.mesh)
        if not self.reuse:
            return self._make(flat, local_shape, shard, start, end)
        key = (flat.data_ptr(), flat.numel(), flat.dtype, tuple(local_shape), repr(shard), start, end)
        if key not in self._made:
            self._made[key] = self._make(flat, local_shape, shard, start, end)
        return self._made[key]

    def _make(self, flat: torch.Tensor, local_shape: Sequence[int], shard, start: int, end: int):
        pcs = pieces(local_shape, shard, start, end)
        if not pcs:
            return None
        views = [flat[p.flat_start - start:p.flat_start - start + p.numel].view(p.sizes) for p in pcs]
        shape = full_shape(local_shape, shard)
        wrapper = LocalShardsWrapper(views, [list(p.offsets) for p in pcs])
        return DTensor.from_local(wrapper, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))


def check_device(tensor: torch.Tensor, mesh: DeviceMesh) -> None:
    """A piece must be on its mesh's device type: ``DTensor.from_local`` would otherwise wrap a
    copy of it on the mesh's device (torch/distributed/tensor/_api.py), which a save copies
    there for nothing and a load fills in place of the tensor itself."""
    if tensor.device.type != mesh.device_type:
        raise ValueError(f"a checkpoint piece on {tensor.device} was handed to a mesh on {mesh.device_type!r}: "
                         f"DTensor.from_local would wrap a copy of it on {mesh.device_type!r}, so a load would "
                         f"not reach the tensor; make it with the maker of its own device "
                         f"(Checkpointer.maker({tensor.device.type!r}))")


def state_key(kind: str, name: str) -> str:
    """The checkpoint key of one kind of state of parameter ``name``."""
    return f"model.{name}" if kind == "param" else f"optim.{kind}.{name}"


MakerFor = Callable[[str], PieceMaker]
"""device type -> the PieceMaker whose mesh is on it (``Checkpointer.maker``)."""


def rank_state(optimizer: ZeroOptimizer, dims: ParallelDims, maker_for: MakerFor,
               with_rng: bool = True, stage: Optional[Stage] = None,
               buffers: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, object]:
    """The DCP state dict of this rank: views of its storage (saving reads them, loading
    writes into them), or, with ``stage``, of host copies taken now (a save in the background).
    Each piece is made by ``maker_for`` the device its tensor (or host copy) is on.
    ``buffers``: the model's saved buffers by their 1-rank name (whole on every rank that
    holds them; DCP writes one copy of a replicated plain tensor)."""
    copy: Stage = stage or (lambda key, tensor: tensor)
    state: Dict[str, object] = {}
    for view in optimizer.checkpoint_views():
        for kind, tensor in view.tensors.items():
            key = state_key(kind, view.name)
            held = copy(key, tensor)
            piece = maker_for(held.device.type)(held, view.local_shape, view.tp_shard, view.start, view.end)
            if piece is not None:
                state[key] = piece
    state["optim.step"] = copy("optim.step", optimizer.step_count)
    for name, tensor in (buffers or {}).items():
        state[f"{BIAS}{name}"] = copy(f"{BIAS}{name}", tensor)
    if optimizer.scaler is not None:
        for name, tensor in optimizer.scaler.persistent().items():
            state[f"loss_scaler.{name}"] = copy(f"loss_scaler.{name}", tensor)
    if with_rng:
        state[f"rng.rank{dims.rank}"] = torch.get_rng_state()
    return state


def after_load(optimizer: ZeroOptimizer, state: Dict[str, object], dims: ParallelDims, with_rng: bool) -> None:
    """Put what DCP loaded into its place where it could not be loaded in place."""
    optimizer.after_load()
    if with_rng:
        torch.set_rng_state(state[f"rng.rank{dims.rank}"])
