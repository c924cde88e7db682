"""Data parallelism with ZeRO (Rajbhandari et al. 2020): gradient reduction over dp and the
optimizer that owns all (stage 0) or 1/dp (stage 1) of the fp32 state.

Both stages share one design (see buckets.py for the buffers and hooks, adamw.py for the
update):

- the model's parameters are views into one flat buffer and their gradients into one flat
  fp32 buffer, cut into buckets whose dp reduction starts inside the last micro-batch's
  backward;
- stage 0 all-reduces every bucket and every rank updates all of it (replicated AdamW);
- stage 1 pads every bucket to a multiple of dp; rank r owns slice r of each bucket. Its
  gradients are reduce-scattered into that slice in place (or all-reduced, whichever the
  backend does faster: ``parallel.zero_reduce``), AdamW updates only the owned slices
  (fp32 master weights and moments exist for those alone), and every bucket's parameters
  are then all-gathered in place in the model's flat buffer. Nothing model-sized is
  allocated after construction.

Stages 2 and 3 (pp == 1) go through FSDP2: parallel/fsdp.py. ``trainer3d.memory`` states what
each stage allocates; tests/test_zero_memory.py holds the engine to it.

The interface the trainer uses: zero_grad, scale_loss, reduce_gradients, grad,
clip_grad_norm, step, step_metrics, state_dict/load_state_dict; for checkpoints, ``owned``
and ``step_count``.
"""

from typing import Dict, List, Tuple

import torch
from torch import nn

from trainer3d.config import Config
from trainer3d.model.init import canonical_name, tp_shard_of
from trainer3d.parallel import comm
from trainer3d.parallel.adamw import FlatAdamW, segments_of
from trainer3d.parallel.buckets import FlatBuffers, GradReducer
from trainer3d.parallel.clip import clip_by_global_norm_, sum_of_squares
from trainer3d.parallel.precision import make_loss_scaler
from trainer3d.parallel.tied import is_tied_copy
from trainer3d.topology import ParallelDims


def counted_once_over_tp(param: torch.Tensor, dims: ParallelDims) -> bool:
    """TP shards are distinct on every tp rank; replicated parameters are counted on tp rank 0."""
    return tp_shard_of(param) is not None or dims.tp_rank == 0


def bucket_numel(cfg: Config) -> int:
    """``parallel.bucket_mb`` MiB of fp32 gradient, in elements."""
    return max(1, int(cfg.parallel.bucket_mb * 2 ** 20) // 4)


def reduce_mode(cfg: Config, dims: ParallelDims) -> str:
    """ZeRO-1's reduction: on gloo all-reduce is faster than reduce-scatter, on NCCL the
    reverse (shared/FACTS.md: gloo 32 MiB dp=2, all_reduce 18.8 ms vs reduce_scatter 32.7 ms)."""
    mode = cfg.parallel.zero_reduce
    if mode == "auto":
        mode = "reduce_scatter" if comm.backend_of(dims.dp_group) == "nccl" else "all_reduce"
    return mode


class FlatZeroOptimizer:
    """ZeRO stage 0 (``sharded=False``) or stage 1 (``sharded=True``) over flat buffers."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims, sharded: bool):
        self.cfg, self.dims, self.sharded = cfg, dims, sharded
        named = [(canonical_name(n), p) for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad]
        names: Dict[nn.Parameter, str] = {p: n for n, p in named}
        self.buffers = FlatBuffers([p for _, p in named], bucket_numel(cfg), dims.dp if sharded else 1)
        mode = reduce_mode(cfg, dims) if sharded else "all_reduce"
        self.reducer = GradReducer(self.buffers, dims.dp_group, dims.dp, dims.dp_rank,
                                   cfg.train.grad_accum_steps, mode)
        self.pieces = self._owned_pieces()
        ranges = {p: self.buffers.range_of(p) for p in self.buffers.params}
        segments = segments_of(names, ranges, self.pieces)
        owned_numel = sum(hi - lo for lo, hi in self.pieces)
        self.adam = FlatAdamW(segments, owned_numel, self.buffers.param_buffer, self.buffers.grad_buffer, cfg.optim)
        self.scaler = make_loss_scaler(self.buffers.param_dtype, dims.device, cfg.train.loss_scale_init)
        self._owned_grads = [self.buffers.grad_buffer[lo:hi] for lo, hi in self.pieces]
        # Each gradient element counted once over the world: ZeRO-1 owners count their slices;
        # stage 0's replicas are identical, so dp rank 0 counts for all of them.
        counts_here = sharded or dims.dp_rank == 0
        self._counted = [g for s, g in zip(segments, self.adam.grad_views)
                         if counts_here and counted_once_over_tp(s.param, dims) and not is_tied_copy(s.name, dims)]

    def _owned_pieces(self) -> List[Tuple[int, int]]:
        if not self.sharded:
            return [(0, self.buffers.numel)]
        out = []
        for b in self.buffers.buckets:
            size = b.numel // self.dims.dp
            lo = b.start + self.dims.dp_rank * size
            out.append((lo, lo + size))
        return out

    # ---------------------------------------------------------------- the trainer's interface

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from (fp16 multiplies by the dynamic loss scale)."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def reduce_gradients(self) -> None:
        """Wait for every bucket's reduction (fp16: and unscale the owned gradients)."""
        self.reducer.finish()
        if self.scaler is not None:
            torch._foreach_mul_(self._owned_grads, self.scaler.inv_scale())

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s view of the fp32 gradient buffer; after reduce_gradients its owned part
        (stage 0: all of it) holds the dp-averaged gradient, and the step reads it there."""
        return self.buffers.grad_view(param)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over tp, pp and dp in one all-reduce; scales the owned gradients."""
        local_sq = sum_of_squares(self._counted, self.dims.device)
        norm = clip_by_global_norm_(local_sq, self._owned_grads, max_norm)
        if self.scaler is not None:
            self.scaler.check(norm)  # an inf/nan anywhere makes the global norm non-finite
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        found_inf = None
        if self.scaler is not None:
            found_inf = self.scaler.found_inf
            self.adam.step(lr, found_inf)
            self.scaler.update()
        else:
            self.adam.step(lr)
        if self.sharded and self.dims.dp > 1:
            self._all_gather_params()

    def _all_gather_params(self) -> None:
        flat, works = self.buffers.param_buffer, []
        for b, (lo, hi) in zip(self.buffers.buckets, self.pieces):
            works.append(comm.all_gather(flat[b.start:b.end], flat[lo:hi], self.dims.dp_group))
        for w in works:
            w.wait()

    def step_metrics(self) -> Dict[str, torch.Tensor]:
        """Device tensors for metrics.jsonl (fp16: loss_scale and skipped)."""
        return self.scaler.metrics() if self.scaler is not None else {}

    # ---------------------------------------------------------------- checkpoints

    @property
    def step_count(self) -> torch.Tensor:
        return self.adam.step_count

    def owned(self) -> List[dict]:
        """Per owned parameter range: name, tp_shard, range of its flattened local tensor and
        views of its fp32 master / exp_avg / exp_avg_sq (see FlatAdamW.owned)."""
        return self.adam.owned()

    def state_dict(self) -> dict:
        state = {"adam": self.adam.state_dict()}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state["adam"])
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


class ReplicatedOptimizer(FlatZeroOptimizer):
    """ZeRO stage 0: AdamW replicated over dp, gradients all-reduced (averaged) in buckets."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        super().__init__(chunks, cfg, dims, sharded=False)


class ShardedOptimizer(FlatZeroOptimizer):
    """ZeRO stage 1: fp32 master weights and AdamW moments sharded over dp."""

    def __init__(self, chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
        super().__init__(chunks, cfg, dims, sharded=True)


def build_optimizer(chunks: List[nn.Module], cfg: Config, dims: ParallelDims):
    stage = cfg.parallel.zero_stage
    if stage == 0:
        return ReplicatedOptimizer(chunks, cfg, dims)
    if stage == 1:
        return ShardedOptimizer(chunks, cfg, dims)
    from trainer3d.parallel.fsdp import FSDPOptimizer
    return FSDPOptimizer(chunks, cfg, dims)
