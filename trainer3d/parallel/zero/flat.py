"""Data parallelism with ZeRO (Rajbhandari et al. 2020): gradient reduction over dp and the
optimizer that owns all (stage 0) or 1/dp (stage 1) of the fp32 state.

Both stages share one design (see buckets.py for the buffers and hooks, trainer3d/optim/adamw.py for the
update):

- the model's parameters are views into one flat buffer and their gradients into one flat
  fp32 buffer, cut into buckets whose dp reduction starts inside the last micro-batch's
  backward;
- stage 0 all-reduces every bucket and every rank updates all of it (replicated AdamW);
- stage 1 pads every bucket to a multiple of dp; rank r owns slice r of each bucket. Its
  gradients are reduce-scattered into that slice in place (or all-reduced, whichever the
  backend does faster: ``parallel.zero_reduce``), AdamW updates only the owned slices
  (fp32 master weights and moments exist for those alone), and every bucket's parameters
  are then all-gathered in place in the model's flat buffer: launched at the end of
  ``step()`` and waited for where the next forward first reads them (param_gather.py).
  Nothing model-sized is allocated after construction.

Stages 2 and 3 (pp == 1) go through FSDP2: parallel/zero/fsdp.py. ``trainer3d.memory.states`` states what
each stage allocates; tests/tools/test_zero_memory.py holds the engine to it.

Stages 0-3 implement the optimizer contract of parallel/zero/optimizer.py, the only way the trainer,
checkpoints and metrics reach them.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.config.schema import Config
from trainer3d.model.init import canonical_name, tp_shard_of
from trainer3d.parallel import comm
from trainer3d.optim.adamw import FlatAdamW, Segment, segments_of
from trainer3d.parallel.zero.buckets import FlatBuffers, GradReducer
from trainer3d.parallel.clip import clip_by_global_norm_, counted_once_over_tp, sum_of_squares
from trainer3d.parallel.zero.muon import FlatMuonAdamW
from trainer3d.parallel.zero.optimizer import StateView, ZeroOptimizer
from trainer3d.parallel.zero.param_gather import DeferredGather
from trainer3d.optim.mixed_precision import DTYPES, make_loss_scaler
from trainer3d.parallel.tied import is_tied_copy
from trainer3d.parallel.wgrad import low_precision_sink
from trainer3d.parallel.topology import ParallelDims


def bucket_numel(cfg: Config) -> int:
    """``parallel.bucket_mb`` MiB of fp32 gradient, in elements."""
    return max(1, int(cfg.parallel.bucket_mb * 2 ** 20) // 4)


def reduce_mode(cfg: Config, dp: comm.Collectives) -> str:
    """ZeRO-1's reduction: ``parallel.zero_reduce``, or for ``auto`` whichever ``dp`` does
    faster (on gloo all-reduce, on NCCL and through one host's shared memory reduce-scatter)."""
    mode = cfg.parallel.zero_reduce
    if mode == "auto":
        mode = "reduce_scatter" if dp.reduce_scatter_is_fast else "all_reduce"
    return mode


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks holding the same parameters, whose gradients are averaged over it and whose
    state ZeRO-1 shards over it: dp x cp for every parameter but expert-parallel experts,
    which have the expert-dp group (parallel/expert/optimizer.py)."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int

    @classmethod
    def dp_cp(cls, dims: ParallelDims) -> "ReplicaGroup":
        return cls(dims.dp_cp_group, dims.dp_cp, dims.dp_cp_rank)


class FlatZeroOptimizer(ZeroOptimizer):
    """ZeRO stage 0 (``sharded=False``) or stage 1 (``sharded=True``) over flat buffers.

    ``overlap_gather``: stage 1 waits for each bucket's parameter all-gather in the next
    forward (param_gather.py) rather than at the end of ``step()``; off only to measure
    what the overlap hides (tools/bench/zero.py). ``trains``: which of the chunks' parameters
    it holds (all by default); ``replicas``: the group they are replicated over (dp x cp);
    ``grad_factor``: what the gradients are multiplied by before their average over it
    (the experts' 1 / ep: parallel/expert/optimizer.py).
    """

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims, sharded: bool,
                 overlap_gather: bool = True, trains: Optional[Callable[[nn.Parameter], bool]] = None,
                 replicas: Optional[ReplicaGroup] = None, grad_factor: float = 1.0):
        self.cfg, self.dims, self.sharded = cfg, dims, sharded
        self.shards_state = sharded
        self.replicas = rep = replicas or ReplicaGroup.dp_cp(dims)
        named = [(canonical_name(n), p) for chunk in chunks for n, p in chunk.named_parameters()
                 if p.requires_grad and (trains is None or trains(p))]
        # A parameter two chunks share (a V's tied embedding, parallel/tied.py) is held once and
        # accumulated by each chunk's backward.
        first: Dict[nn.Parameter, str] = {}
        uses: Dict[nn.Parameter, int] = {}
        for n, p in named:
            first.setdefault(p, n)
            uses[p] = uses.get(p, 0) + 1
        named = [(n, p) for p, n in first.items()]
        self.names: Dict[nn.Parameter, str] = {p: n for n, p in named}
        dtype = DTYPES[cfg.train.dtype]
        self.buffers = FlatBuffers([p for _, p in named], bucket_numel(cfg), rep.size if sharded else 1, dtype)
        # the buckets' collectives over dp, and the gradient norm's sum over the world (the dp
        # group's where that is the world), each built once (comm.collectives)
        largest = max(b.numel for b in self.buffers.buckets)
        self.dp = (comm.collectives(rep.group, dims.device, largest) if rep.size > 1
                   else comm.GroupCollectives(rep.group))
        self.world = (self.dp if rep.size == dims.topo.world_size else
                      comm.collectives(None, dims.device, 64) if dims.topo.world_size > 1 else comm.GroupCollectives())
        mode = reduce_mode(cfg, self.dp) if sharded else "all_reduce"
        self.reducer = GradReducer(self.buffers, self.dp, rep.size, rep.rank, cfg.train.grad_accum_steps, mode,
                                   [uses[p] for p in self.buffers.params], grad_factor)
        # bf16/fp16: the linear layers' backward accumulates into the fp32 buffer (wgrad.py)
        self.wgrad_sink = low_precision_sink(self.buffers.params, self.buffers.grad_view, dtype)
        self.pieces = self._owned_pieces()
        ranges = {p: self.buffers.range_of(p) for p in self.buffers.params}
        segments = segments_of(self.names, ranges, self.pieces)
        owned_numel = sum(hi - lo for lo, hi in self.pieces)
        self.adam = self._make_adam(segments, owned_numel)
        self.step_count = self.adam.step_count
        self.scaler = make_loss_scaler(dtype, dims.device, cfg.train.loss_scale_init)
        self._owned_grads = [self.buffers.grad_buffer[lo:hi] for lo, hi in self.pieces]
        # Each gradient element counted once over the world: ZeRO-1 owners count their slices;
        # stage 0's replicas are identical, so dp rank 0 counts for all of them.
        counts_here = sharded or rep.rank == 0
        self._counted = [g for s, g in zip(segments, self.adam.grad_views)
                         if counts_here and counted_once_over_tp(s.param, dims) and not is_tied_copy(s.name, dims)]
        self.deferred = None
        if sharded and rep.size > 1 and overlap_gather:
            self.deferred = DeferredGather(chunks, {p: b.index for b in self.buffers.buckets for p in b.params})

    def _make_adam(self, segments: List[Segment], owned_numel: int):
        """The AdamW state of the owned pieces, on the device (parallel/zero/offload.py: on the host);
        with ``optim.name=muon``, Muon's for the blocks' matrices and AdamW's for the rest (muon.py)."""
        if self.cfg.optim.name == "muon":
            dp = self.dp if self.sharded and self.replicas.size > 1 else None
            return FlatMuonAdamW(segments, self.buffers, self.cfg, dp, self.pieces, self.dims.tp_group, self.names,
                                 self.dims.dp_cp_group)
        return FlatAdamW(segments, owned_numel, self.buffers.param_buffer, self.buffers.grad_buffer, self.cfg.optim)

    def _owned_pieces(self) -> List[Tuple[int, int]]:
        if not self.sharded:
            return [(0, self.buffers.numel)]
        out = []
        for b in self.buffers.buckets:
            size = b.numel // self.replicas.size
            lo = b.start + self.replicas.rank * size
            out.append((lo, lo + size))
        return out

    def parameters(self) -> List[nn.Parameter]:
        self.wait_params()
        return list(self.names)

    def owned_ranges(self, param: torch.Tensor) -> List[Tuple[int, int]]:
        return [s.local_range for s in self.adam.segments if s.param is param]

    def wait_params(self) -> None:
        if self.deferred is not None:
            self.deferred.wait_all()

    # ---------------------------------------------------------------- one step

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def reduce_gradients(self) -> None:
        """Wait for every bucket's reduction (fp16: and unscale the owned gradients)."""
        self.reducer.finish()
        if self.scaler is not None:
            torch._foreach_mul_(self._owned_grads, self.scaler.inv_scale())

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s view of the fp32 gradient buffer; after reduce_gradients its owned part
        (stage 0: all of it) holds the dp-averaged gradient, and the step reads it there."""
        return self.buffers.grad_view(param)

    def local_sum_of_squares(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (each element counted once over the world)."""
        return sum_of_squares(self._counted, self.dims.device)

    def owned_grads(self) -> List[torch.Tensor]:
        """The gradient pieces this rank updates from (what clipping scales)."""
        return self._owned_grads

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = clip_by_global_norm_(self.local_sum_of_squares(), self._owned_grads, max_norm, self.world)
        if self.scaler is not None:
            self.scaler.check(norm)  # an inf/nan anywhere makes the global norm non-finite
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        found_inf = self.scaler.found_inf if self.scaler is not None else None
        self.wait_params()  # the update writes the owned slices the last gather sends from
        self.adam.step(lr, found_inf)
        if self.scaler is not None:
            self.scaler.update()
        self._gather_params(defer=True)

    def _gather_params(self, defer: bool = False) -> None:
        """Stage 1: every bucket's parameters from their owners, in place in the flat buffer,
        launched in forward order (the embedding's bucket, laid out last, first); ``defer``:
        waited for where they are read (param_gather.py), else now."""
        if not self.sharded or self.replicas.size == 1:
            return
        flat, works = self.buffers.param_buffer, {}
        for b, (lo, hi) in reversed(list(zip(self.buffers.buckets, self.pieces))):
            works[b.index] = self.dp.all_gather(flat[b.start:b.end], flat[lo:hi])
        if defer and self.deferred is not None:
            self.deferred.hand_over(works)
            return
        for w in works.values():
            w.wait()

    # ---------------------------------------------------------------- checkpoints, memory

    def checkpoint_views(self) -> List[StateView]:
        """Every parameter whole (each rank holds all of them), and the optimizer state of the
        owned segments: a parameter's range of its flattened tp-local tensor."""
        self.wait_params()  # a save must read, a load must not be overwritten by, the gather
        views = [StateView(self.names[p], tuple(p.shape), tp_shard_of(p), 0, p.numel(), {"param": p.detach().view(-1)})
                 for p in self.buffers.params]
        for s, kinds in self.adam.state_views():
            views.append(StateView(s.name, tuple(s.param.shape), s.tp_shard, *s.local_range, kinds))
        return views

    @torch.no_grad()
    def after_load(self) -> None:
        self.wait_params()
        if self.adam.master is not None:  # mixed precision: the parameters are the masters' cast
            self.adam.copy_master_to_params()
            self._gather_params()

    def state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        a = self.adam
        own = (a.state_buffers() if isinstance(a, FlatMuonAdamW) else
               {"master": [a.master] if a.master is not None else [], "optimizer": [a.exp_avg, a.exp_avg_sq]})
        return {"params": [self.buffers.param_buffer], "grads": [self.buffers.grad_buffer],
                "master": own["master"], "optimizer": [*own["optimizer"], *self._scalar_tensors()]}


class ReplicatedOptimizer(FlatZeroOptimizer):
    """ZeRO stage 0: AdamW replicated over dp, gradients all-reduced (averaged) in buckets."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        super().__init__(chunks, cfg, dims, sharded=False)


class ShardedOptimizer(FlatZeroOptimizer):
    """ZeRO stage 1: fp32 master weights and AdamW moments sharded over dp."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims, overlap_gather: bool = True):
        super().__init__(chunks, cfg, dims, sharded=True, overlap_gather=overlap_gather)
