"""Muon under ZeRO 0/1 and tensor parallelism: every Muon matrix orthogonalised whole, once per
dp group.

The flat optimizer (flat.py) owns pieces of the flat buffers; Muon's elementwise half (the
momentum and the Nesterov look-ahead, trainer3d/optim/muon.py) runs on the owned pieces, so its
one fp32 momentum buffer is sharded over dp like AdamW's two moments. Newton-Schulz (NS) needs
the whole logical matrix, which two gathers assemble in the gradient buffer's own storage:

1. dp (ZeRO-1, dp > 1): each bucket holding a Muon matrix is all-gathered in place from its
   owners' look-ahead slices, as the parameters are after the step (the buffer's other
   elements are this step's gradient, no longer read) — every dp rank then holds the
   look-ahead of every matrix of its stage;
2. tp: a column- or row-parallel weight's tp-local look-ahead is all-gathered over tp along
   its split dim into one transient full matrix.

ZeRO-1 with dp > 1 and ``optim.muon.layer_wise`` (the default), Megatron-Core's layer-wise
layout (megatron/core/optimizer/layer_wise_optimizer.py): each Muon parameter has one NS owner
in the dp group (``ns_owners``, balanced by NS FLOPs); the owner's tp ranks orthogonalise it and
the owner broadcasts its tp-local result over dp into every rank's gradient buffer, where the
update reads it. The broadcast copies bits, so every rank updates with what the redundant
layout computes. Otherwise (ZeRO-0, dp = 1, or ``layer_wise=false``) every rank runs NS on
every matrix of its stage. tp ranks still each orthogonalise the full matrix they gathered.

Each rank keeps its own slice in the gradient buffer and updates the owned pieces of the
parameters (fp32 masters). Pipeline stages hold disjoint matrices and need nothing. AdamW steps
the other parameters.
"""

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from trainer3d.config.schema import Config
from trainer3d.model.init import tp_shard_of
from trainer3d.optim.adamw import FlatAdamW, Segment
from trainer3d.optim.muon import adjusted_lr, is_muon_param, matrices, matrix_shape, momentum_lookahead_, newton_schulz
from trainer3d.parallel import comm
from trainer3d.parallel.zero.buckets import FlatBuffers


def repacked(segments: List[Segment]) -> List[Segment]:
    """``segments`` with their state offsets laid end to end (one state buffer for them alone)."""
    out, offset = [], 0
    for s in segments:
        out.append(dataclasses.replace(s, state_offset=offset))
        offset += s.numel
    return out


def full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The logical shape of ``p`` (a tp shard's full length along its split dim)."""
    shape, shard = list(p.shape), tp_shard_of(p)
    if shard is not None:
        shape[shard.dim] = shard.full
    return tuple(shape)


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on one rows x cols matrix: with m <= n its
    sides, X Xᵀ (2 m² n), the quintic's A·A (2 m³) and its product with X (2 m² n) per iteration."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def ns_cost(shape: Sequence[int], tp_sharded: bool, steps: int) -> Tuple[int, int, int, bool]:
    """What ``ns_owners`` balances a parameter of logical ``shape`` by: its NS FLOPs (each
    expert's matrix of a stacked 3-D weight its own), then its elements, smaller side and tp
    sharding (what its step transient depends on: trainer3d/memory/muon_step.py), so parameters
    that tie are alike in all of them."""
    return _ns_cost(tuple(shape), tp_sharded, steps)


@functools.lru_cache(maxsize=4096)
def _ns_cost(shape: Tuple[int, ...], tp_sharded: bool, steps: int) -> Tuple[int, int, int, bool]:
    """``ns_cost``, cached on its arguments: the planner (trainer3d/plan/muon_cost.py,
    trainer3d/memory/muon_step.py) asks it for every matrix of every layout it tries, of a
    model with a few distinct shapes."""
    rows, cols = shape[-2:]
    experts = math.prod(shape[:-2])
    return experts * ns_flops(rows, cols, steps), experts * rows * cols, min(rows, cols), tp_sharded


def ns_owners(costs: Sequence[Tuple[int, ...]], ranks: int) -> List[int]:
    """The rank of ``ranks`` that orthogonalises each parameter of ``costs`` (its Newton-Schulz
    FLOPs first, then anything to rank equal ones by): longest processing time first, as
    Megatron-Core's layer-wise distributed optimizer balances its shards
    (megatron/core/optimizer/layer_wise_optimizer.py): the costliest parameter goes to the least
    loaded rank, ties to the lower index. Which parameters a rank gets depends on the multiset
    of costs alone, so the planner and the memory accounting reproduce each rank's share."""
    return list(_ns_owners(tuple(costs), ranks))


@functools.lru_cache(maxsize=256)
def _ns_owners(costs: Tuple[Tuple[int, ...], ...], ranks: int) -> Tuple[int, ...]:
    """``ns_owners``, cached on its arguments (the planner asks it for each layout's ranks)."""
    loads, owners = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: costs[i], reverse=True):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i][0]
    return tuple(owners)


class FlatMuonAdamW:
    """Muon state for the owned pieces of the Muon matrices, AdamW (``FlatAdamW``) for the rest;
    the same face as ``FlatAdamW`` to flat.py."""

    def __init__(self, segments: List[Segment], buffers: FlatBuffers, cfg: Config, dp: Optional[comm.Collectives],
                 pieces: List[Tuple[int, int]], tp_group, names: Dict[torch.nn.Parameter, str], dp_group=None):
        """``dp``: ZeRO-1's collectives over dp (None: every rank holds whole buckets); ``dp_group``
        the same group's process group, which the layer-wise broadcasts go through."""
        self.segments, self.cfg, self.buffers = segments, cfg, buffers
        self.dp, self.pieces, self.tp_group = dp, pieces, tp_group
        muon = [s for s in segments if is_muon_param(s.name, s.param)]
        rest = repacked([s for s in segments if not is_muon_param(s.name, s.param)])
        self.adam = FlatAdamW(rest, sum(s.numel for s in rest), buffers.param_buffer, buffers.grad_buffer, cfg.optim)
        self.step_count = self.adam.step_count
        self.muon_segments = repacked(muon)
        numel, device = sum(s.numel for s in self.muon_segments), buffers.param_buffer.device
        self.momentum = torch.zeros(numel, dtype=torch.float32, device=device)
        self.master: Optional[torch.Tensor] = None
        if buffers.param_dtype != torch.float32:
            self.master = torch.zeros(numel, dtype=torch.float32, device=device)
        self.grad_views = [buffers.grad_buffer[s.start:s.end] for s in segments]  # flat.py counts the norm on these
        self._param_views = [buffers.param_buffer[s.start:s.end] for s in self.muon_segments]
        self._grads = [buffers.grad_buffer[s.start:s.end] for s in self.muon_segments]
        self._bufs = [self.momentum[s.state_offset:s.state_offset + s.numel] for s in self.muon_segments]
        self._masters = ([self.master[s.state_offset:s.state_offset + s.numel] for s in self.muon_segments]
                         if self.master is not None else self._param_views)
        if self.master is not None and self._masters:
            with torch.no_grad():
                torch._foreach_copy_(self._masters, self._param_views)
        self.muon_params = [p for p in buffers.params if is_muon_param(names[p], p)]
        muon_set = set(self.muon_params)
        self._buckets = [(b, piece) for b, piece in zip(buffers.buckets, pieces) if muon_set & set(b.params)]
        self.orthogonalised, self._broadcasts = self.muon_params, []
        if dp is not None and cfg.optim.muon.layer_wise:
            self._own_share(dp_group)

    def _own_share(self, dp_group) -> None:
        """Layer-wise: NS only for the parameters this dp rank owns; every parameter's result
        broadcast from its owner (global rank) over ``dp_group``."""
        costs = [ns_cost(full_shape(p), full_shape(p) != tuple(p.shape), self.cfg.optim.muon.ns_steps)
                 for p in self.muon_params]
        owners = ns_owners(costs, dist.get_world_size(dp_group))
        me = dist.get_rank(dp_group)
        self.orthogonalised = [p for p, o in zip(self.muon_params, owners) if o == me]
        self._broadcasts = [(p, dist.get_global_rank(dp_group, o)) for p, o in zip(self.muon_params, owners)]
        self._dp_group = dp_group

    @torch.no_grad()
    def step(self, lr: float, found_inf: Optional[torch.Tensor] = None) -> None:
        """AdamW on the rest; Muon on the owned pieces of every Muon matrix (``found_inf`` is
        never set: validation refuses fp16 with Muon)."""
        m = self.cfg.optim.muon
        muon_lr = lr * m.lr / self.cfg.optim.lr  # the same schedule, Muon's own peak
        momentum_lookahead_(self._grads, self._bufs, m.momentum, m.nesterov)
        self._gather_over_dp()
        for p in self.orthogonalised:
            self._orthogonalise_(p)
        self._broadcast_from_owners()
        for s, master, update in zip(self.muon_segments, self._masters, self._grads):
            master.mul_(1 - muon_lr * m.weight_decay)
            master.add_(update, alpha=-adjusted_lr(muon_lr, m.adjust_lr, matrix_shape(full_shape(s.param))))
        self.adam.step(lr, found_inf)
        self._copy_master_to_muon_params()

    def _gather_over_dp(self) -> None:
        """ZeRO-1: the owners' look-ahead slices of every bucket holding a Muon matrix, everywhere."""
        if self.dp is None:
            return
        flat = self.buffers.grad_buffer
        works = [self.dp.all_gather(flat[b.start:b.end], flat[lo:hi]) for b, (lo, hi) in self._buckets]
        for w in works:
            w.wait()

    def _broadcast_from_owners(self) -> None:
        """Layer-wise: each parameter's tp-local NS result, from its owner to the dp group, in
        place in the gradient buffer (a parameter's view of it is contiguous)."""
        works = [dist.broadcast(self.buffers.grad_view(p), src, group=self._dp_group, async_op=True)
                 for p, src in self._broadcasts]
        for w in works:
            w.wait()

    def _orthogonalise_(self, p: torch.nn.Parameter) -> None:
        """NS of ``p``'s full look-ahead, this rank's slice of it written back in place."""
        local = self.buffers.grad_view(p)
        shard = tp_shard_of(p)
        full = local
        if shard is not None and shard.size > 1:
            parts = [torch.empty_like(local) for _ in range(shard.size)]
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
            full = torch.cat(parts, dim=shard.dim)
        m = self.cfg.optim.muon
        dtype = torch.float32 if m.ns_dtype == "fp32" else torch.bfloat16
        ortho = torch.stack([newton_schulz(g, m.ns_steps, m.eps, dtype) for g in matrices(full)]).view(full.shape)
        if full is not local:
            ortho = ortho.narrow(shard.dim, shard.rank * local.shape[shard.dim], local.shape[shard.dim])
        local.copy_(ortho)

    @torch.no_grad()
    def _copy_master_to_muon_params(self) -> None:
        if self.master is not None and self._masters:
            torch._foreach_copy_(self._param_views, self._masters)

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        self.adam.copy_master_to_params()
        self._copy_master_to_muon_params()

    def state_views(self) -> List[Tuple[Segment, Dict[str, torch.Tensor]]]:
        out = self.adam.state_views()
        for s, buf, master in zip(self.muon_segments, self._bufs, self._masters):
            kinds = {"momentum_buffer": buf}
            if self.master is not None:
                kinds["master"] = master
            out.append((s, kinds))
        return out

    def state_buffers(self) -> Dict[str, List[torch.Tensor]]:
        """The optimizer's own tensors by memory term (flat.py's ``state_tensors``)."""
        return {"master": [t for t in (self.adam.master, self.master) if t is not None],
                "optimizer": [self.adam.exp_avg, self.adam.exp_avg_sq, self.momentum]}
