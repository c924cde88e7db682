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
hands them to DCP as ``Pieces``: a tensor of the full shape whose pieces are views into this
rank's own storage, wherever it is (the live state of an offloaded run is partly in host
memory: parallel/zero/offload.py, fsdp_offload.py), with each piece's offsets in the full tensor.
DCP then writes each piece once (replicas over dp and tp write the same pieces; DCP keeps
one) and, on load, reads into every rank's views exactly the regions it holds now — which
is what makes a checkpoint load into any other (tp, pp, dp, zero_stage): the stored tensors
never depend on the layout. Pipeline stages simply hold different names.

Only tensors go into the checkpoint (no pickled Python objects), so loading one never
unpickles anything; the step, the layout and the config go into the JSON marker.
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from trainer3d.checkpoint.chunks import full_shape, pieces
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.parallel.topology import ParallelDims


BIAS = "moe_bias."
"""The key prefix of aux_free's routing biases."""

Stage = Callable[[str, torch.Tensor], torch.Tensor]
"""(state key, tensor) -> the host copy a save writes (trainer3d/checkpoint/staging.py)."""


class Pieces(torch.Tensor):
    """This rank's pieces of one full tensor, as DCP saves and loads them: a tensor of the full
    shape that holds no data of its own. DCP asks a tensor it cannot slice itself for its write
    items, its chunks and the tensor of each chunk (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``: torch/distributed/checkpoint/planner_helpers.py
    and utils.py); torch's ``LocalShardsWrapper`` answers them for the views, told the full size
    by this tensor, as a DTensor over it would (torch/distributed/tensor/_api.py). Not a DTensor:
    building one imports torch._dynamo (``DTensor.__init__`` is wrapped by ``torch._disable_dynamo``,
    torch/_compile.py), seconds of CPU in every rank that saves, and ``DTensor.from_local`` copies
    a piece to its mesh's device (host state of an offloaded run onto the GPU: a save would copy
    it there and a load fill the copy). A piece here is the view it was given."""

    @staticmethod
    def __new__(cls, views: Sequence[torch.Tensor], offsets: Sequence[Sequence[int]], shape: Sequence[int]):
        made = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=views[0].dtype,
                                                   device=views[0].device)
        made.held = LocalShardsWrapper(list(views), [list(o) for o in offsets])
        return made

    def __create_write_items__(self, fqn: str, obj: object):
        return self.held.__create_write_items__(fqn, self)

    def __create_chunk_list__(self):
        return self.held.__create_chunk_list__()

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.held.__get_tensor_shard__(index)

    def local_shards(self) -> List[torch.Tensor]:
        """The views, in the order they were given."""
        return self.held.local_shards()

    def __repr__(self) -> str:  # torch's would run an operator on a tensor without data
        offsets = [tuple(o) for o in self.held.local_offsets()]
        return f"Pieces({tuple(self.shape)}, {self.dtype}, {self.device}, offsets {offsets})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on checkpoint pieces: they are for DCP's save and load only")


class PieceMaker:
    """Wraps views of this rank's storage (or of its host copy) as ``Pieces``."""

    def __init__(self, reuse: bool = False):
        self.reuse = reuse
        """Keep each piece made and return it again for the same storage and region: for the
        staging buffers, which every background save refills in place (wrapping ~150 pieces
        took half of a save's stall: tools/bench/checkpoint.py). A kept piece holds its storage
        alive, so no other tensor can take its address while it is kept."""
        self._made: Dict[tuple, object] = {}

    def __call__(self, flat: torch.Tensor, local_shape: Sequence[int], shard, start: int, end: int):
        """``flat`` holds elements [start, end) of the flattened local tensor of ``local_shape``;
        None when they are all padding."""
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
        return Pieces(views, [p.offsets for p in pcs], full_shape(local_shape, shard))


def state_key(kind: str, name: str) -> str:
    """The checkpoint key of one kind of state of parameter ``name``."""
    return f"model.{name}" if kind == "param" else f"optim.{kind}.{name}"


def rank_state(optimizer: ZeroOptimizer, dims: ParallelDims, maker: PieceMaker,
               with_rng: bool = True, stage: Optional[Stage] = None,
               buffers: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, object]:
    """The DCP state dict of this rank: views of its storage (saving reads them, loading
    writes into them), or, with ``stage``, of host copies taken now (a save in the background).
    ``buffers``: the model's saved buffers by their 1-rank name (whole on every rank that
    holds them; DCP writes one copy of a replicated plain tensor)."""
    copy: Stage = stage or (lambda key, tensor: tensor)
    state: Dict[str, object] = {}
    for view in optimizer.checkpoint_views():
        for kind, tensor in view.tensors.items():
            key = state_key(kind, view.name)
            held = copy(key, tensor)
            piece = maker(held, view.local_shape, view.tp_shard, view.start, view.end)
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
