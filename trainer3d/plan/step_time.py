"""Predicted time of one training step of a validated layout on a Device.

The slowest pipeline rank's micro-batch, forward and backward by term, is micro_batch_time.py's;
the offloaded optimizer's term is offload_cost.py's; this module puts them together with the
pipeline's fill and drain, the data-parallel communication and the optimizer:

    step = (m + (p - 1) / v) x (slowest rank's forward + backward + 2 v hand-overs, each a
                                              send and the schedule's host time per action)
                                              the bubble: (p - 1) / (v m) of the compute
         + data-parallel reduction            bucketed, overlapped with the last micro-batch's
                                              backward except the last bucket; ZeRO-1's
                                              parameter all-gather, overlapped with the next
                                              first forward except the first bucket; FSDP2's
                                              un-overlapped share, one collective's latency
                                              per sharded unit (every block and the root)
         + optimizer                          AdamW over the owned elements, memory-bound (optim=muon:
                                              + Newton-Schulz and its gathers, plan/muon_cost.py)
         + offload                            parallel.offload_optimizer: the gradients' copy to
                                              the host (overlapped with the last micro-batch's
                                              backward except the last bucket), the host AdamW
                                              (memory-bound, the node's host bandwidth shared by
                                              its ranks) and the parameters' copy back; ZeRO-2/3
                                              (FSDP2's CPUOffloadPolicy): every micro-batch's
                                              shard copies up and gradient copies down, the
                                              later micro-batches' down copies and host sums
                                              not overlapped, then the host AdamW
         + host                               the engine's own time per step outside the blocks
                                              (CPUs: measured by --calibrate; 0 on GPUs)

Ring collectives cost 2 (n-1)/n B / bandwidth + 2 (n-1) hops of latency (all-reduce), half
that for an all-gather or reduce-scatter (Patarasuk & Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations"). Where the ranks of a node share its
cores (CPUs) a step also takes at least the node's total work over the node's throughput
(``Device.node_rate``): the rank waiting in a bubble lends its core to the others.
"""

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional

from trainer3d.memory.activations import FP32, Sizes
from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import zero_shards
from trainer3d.memory.rank_layout import model_key
from trainer3d.memory.states import BYTES, ModelStateBytes
from trainer3d.parallel.pipeline.bubble import bubble_theory
from trainer3d.parallel.pipeline.timeline import ZERO_BUBBLE
from trainer3d.plan.block_time import BlockTime, all_reduce_s
from trainer3d.plan.devices import Device
from trainer3d.plan.links import _link_gbps, gather_s, overlap_cost
from trainer3d.plan.micro_batch_time import BlockKey, RankTimes, micro_batch_times
from trainer3d.plan.moe_cost import expert_gradient_bytes
from trainer3d.plan.muon_cost import muon_s
from trainer3d.plan.offload_cost import HostLink, fsdp_offload_s, offload_s

ADAMW_BYTES = 36  # per owned element: read grad, moments, master/param; write moments, master/param (+16-bit copy)


def unit_gathers_s(nbytes: float, units: int, n: int, gbps: float, latency_us: float) -> float:
    """All-gathers (or reduce-scatters) of ``nbytes`` in ``units`` collectives, one per
    sharded unit: the bytes once, the ring's hops once per unit."""
    return 0.0 if n == 1 else gather_s(nbytes, n, gbps, 0.0) + units * (n - 1) * latency_us * 1e-6


@dataclass
class StepTime:
    """Seconds of one step, by part; ``total`` is the prediction.

        compute     m micro-batches of the slowest rank (its tensor-parallel collectives included)
        tp_comm     the tensor-parallel share of compute
        bubble      pipeline fill and drain: (p - 1) / v slots of the slowest rank
        pp_comm     hand-overs between stages on the critical path
        dp_comm     data-parallel communication not hidden behind backward
        optimizer   AdamW over the owned elements, zeroing and clipping the gradients
        offload     the offloaded optimizer's host step and the transfers not hidden behind backward
        node_bound  shared cores: the node's work over its throughput, when that exceeds
                    the critical path (0 where every rank has its own device)
        host        the engine's host time per step outside the blocks (data, loss and
                    optimizer bookkeeping, metrics), ``Device.step_overhead_us``
    """

    compute: float = 0.0
    tp_comm: float = 0.0
    bubble: float = 0.0
    pp_comm: float = 0.0
    dp_comm: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0
    node_bound: float = 0.0
    host: float = 0.0
    compute_terms: Dict[str, float] = field(default_factory=dict)
    """``compute`` by term (the slowest rank's m micro-batches: gemm, attention, elementwise,
    tp_comm, launch, recompute, head; block_time.py)."""

    def terms(self) -> Dict[str, float]:
        """Every term by name, ``compute``'s parts as ``compute.<part>`` after it (``tp_comm``
        is one of them); the step is compute + bubble + pp_comm (or node_bound) + dp_comm +
        optimizer + offload + host."""
        out: Dict[str, float] = {}
        for f in fields(self):
            if f.name in ("tp_comm", "compute_terms"):
                continue
            out[f.name] = getattr(self, f.name)
            if f.name == "compute":
                parts = self.compute_terms or {"tp_comm": self.tp_comm}
                out.update({f"compute.{name}": value for name, value in sorted(parts.items(), key=lambda kv: -kv[1])})
        return out

    @property
    def critical_path(self) -> float:
        return self.compute + self.bubble + self.pp_comm

    @property
    def total(self) -> float:
        return max(self.critical_path, self.node_bound) + self.dp_comm + self.optimizer + self.offload + self.host


def _dp_exposed(cfg: Config, device: Device, states: ModelStateBytes, times: RankTimes,
                ranks_per_node: int, backend: str, pp_rank: int = 0) -> float:
    """The data-parallel communication one step waits for, plus what the part it overlaps
    with compute costs that compute (``overlap_cost``)."""
    p = cfg.parallel
    n = p.dp * p.cp  # gradients are reduced, and ZeRO shards, over dp x cp
    if n == 1:
        return 0.0
    if p.zero_stage in (2, 3):
        return _fsdp_exposed(cfg, device, states, times, ranks_per_node)
    gbps = _link_gbps(device, p.tp * n, ranks_per_node, min(n, ranks_per_node // p.tp))
    lat = device.latency(min(ranks_per_node, p.tp * p.pp * n))
    grads = states.grads
    scatter = p.zero_stage == 1 and backend == "nccl"
    dense, experts = expert_gradient_bytes(cfg, pp_rank, grads)  # ep: experts over dp x cp / ep (plan/moe_cost.py)
    reduce = gather_s(dense, n, gbps, lat) if scatter else all_reduce_s(dense, n, gbps, lat)
    e_n = n // p.ep  # the expert-data-parallel group: every ep-th member of dp x cp, tp x ep ranks apart
    e_gbps = _link_gbps(device, p.tp * n, ranks_per_node, max(1, min(e_n, ranks_per_node // (p.tp * p.ep))))
    if experts:
        reduce += gather_s(experts, e_n, e_gbps, lat) if scatter else all_reduce_s(experts, e_n, e_gbps, lat)
    bucket_share = min(1.0, p.bucket_mb * 2 ** 20 / max(1, grads))
    last_bucket = reduce * bucket_share
    exposed = last_bucket + max(0.0, reduce - last_bucket - times.backward)
    hidden = reduce - exposed
    if p.zero_stage == 1:  # waited for bucket by bucket in the next first forward (parallel/zero/param_gather.py)
        expert_params = experts // FP32 * BYTES[cfg.train.dtype]  # gathered over the expert-data-parallel group
        gather = gather_s(states.params - expert_params, n, gbps, lat)
        gather += gather_s(expert_params, e_n, e_gbps, lat) if experts else 0.0
        gather_exposed = gather * bucket_share + max(0.0, gather * (1 - bucket_share) - times.forward)
        exposed += gather_exposed
        hidden += gather - gather_exposed
    return exposed + overlap_cost(device, hidden)


def _fsdp_exposed(cfg: Config, device: Device, states: ModelStateBytes, times: RankTimes,
                  ranks_per_node: int) -> float:
    """ZeRO-2/3 (FSDP2), per micro-batch: the units' all-gathers (forward; ZeRO-3 backward too)
    and gradient reduce-scatters inside the shard group of n = ``zero_shards`` ranks (S x tp
    consecutive ranks: a node's links where they fit in one), and under HSDP the all-reduce of
    each unit's fp32 gradient shard over the dp x cp / n replicas (one member per replica, a
    node or more apart: each through its own NIC), all during backward; what compute does not
    hide is exposed, plus the first unit's gather."""
    p, t = cfg.parallel, cfg.train
    n, replicas = zero_shards(p), p.dp * p.cp // zero_shards(p)
    params = states.sharded * n  # the unsharded parameters FSDP2 gathers (padded rows included)
    units = cfg.model.n_layers + 1  # FSDP2 units: every block and the root (parallel/zero/fsdp.py)
    gbps = _link_gbps(device, p.tp * n, ranks_per_node, min(n, ranks_per_node // p.tp))
    lat = device.latency(min(ranks_per_node, p.tp * n))
    gather = unit_gathers_s(BYTES[t.dtype] * params, units, n, gbps, lat)
    scatter = unit_gathers_s(FP32 * params, units, n, gbps, lat)
    if replicas > 1:
        span = p.tp * p.dp * p.cp
        r_gbps, r_lat = _link_gbps(device, span, ranks_per_node), device.latency(min(ranks_per_node, span))
        # one all-reduce per unit: the bytes once, the ring's hops per unit
        scatter += all_reduce_s(FP32 * states.sharded, replicas, r_gbps, 0.0) + units * 2 * (replicas - 1) * r_lat * 1e-6
    bwd_gather = gather if p.zero_stage == 3 else 0.0
    fwd_exposed, bwd_exposed = max(0.0, gather - times.forward), max(0.0, bwd_gather + scatter - times.backward)
    m = t.grad_accum_steps
    hidden = m * (gather + bwd_gather + scatter - fwd_exposed - bwd_exposed)
    return m * (fwd_exposed + bwd_exposed) + gather / units + overlap_cost(device, hidden)


def step_time(cfg: Config, device: Device, states: Dict[int, ModelStateBytes], ranks_per_node: int,
              backend: str = "nccl", attention: str = "flash", link: Optional[HostLink] = None,
              model: Optional[str] = None, blocks: Optional[Dict[BlockKey, BlockTime]] = None) -> StepTime:
    """``states``: model states of the pipeline ranks to time (at least the first and the
    last: the others differ only by the layers they hold, balanced by the stage split);
    ``attention``: the attention kernel (``cluster.attention``, kernels.py); ``link``: the host's
    figures for an offloaded optimizer; ``model``: ``model_key(cfg)`` where the caller has it;
    ``blocks``: block times on ``device`` already timed (micro_batch_time.py ``block_key``), which
    the search keeps for all its layouts."""
    p, t = cfg.parallel, cfg.train
    m, v = t.grad_accum_steps, p.pp_virtual_stages
    node_ranks = min(ranks_per_node, p.tp * p.cp * p.pp * p.dp)
    blocks = {} if blocks is None else blocks  # each kind of block timed once for all the ranks
    model = model if model is not None else model_key(cfg)
    times: Dict[int, RankTimes] = {r: micro_batch_times(cfg, device, r, node_ranks, attention, blocks, model)
                                   for r in states}
    slowest = max(times, key=lambda r: times[r].forward + times[r].backward)
    busy = times[slowest].forward + times[slowest].backward
    z = Sizes.of(cfg)
    hop = 0.0
    if p.pp > 1:
        gbps = _link_gbps(device, p.tp * p.cp * p.dp * p.pp, ranks_per_node)
        hop = z.hidden_bytes() / (gbps * 1e9) + (device.latency(node_ranks) + device.pipeline_action(node_ranks)) * 1e-6
    slot = busy + 2 * v * hop
    fill = (p.pp - 1) / v
    if p.pp > 1 and p.pp_schedule in ZERO_BUBBLE:
        # The idle share b of torch's own action lists with unit costs (timeline.py, which the
        # executed order is held to): the step spans m slots / (1 - b), m of them busy.
        b = bubble_theory(p.pp, m, v, p.pp_schedule)
        fill = m * b / (1 - b)
    optimizer = max(_optimizer_s(cfg, device, s) + muon_s(cfg, device, r, node_ranks) for r, s in states.items())
    dp = max(_dp_exposed(cfg, device, s, times[r], ranks_per_node, backend, r) for r, s in states.items())
    if p.zero_stage >= 2:
        offload = max(fsdp_offload_s(cfg, s, times[r], node_ranks, link or HostLink()) for r, s in states.items())
    else:
        offload = max(offload_s(cfg, s, times[r].backward, node_ranks, link or HostLink()) for r, s in states.items())
    # > 1 where the node's ranks share cores: their work, at one rank's speed alone, over the node's rate
    share = node_ranks * device.rank_speed(node_ranks) / device.node_rate(node_ranks)
    mean_compute = sum(m * (x.forward + x.backward) for x in times.values()) / len(times)
    return StepTime(compute=m * busy, tp_comm=m * times[slowest].tp_comm, bubble=fill * slot,
                    pp_comm=m * 2 * v * hop, dp_comm=share * dp, optimizer=share * optimizer, offload=offload,
                    node_bound=share * mean_compute if share > 1 else 0.0, host=device.step_overhead_us * 1e-6,
                    compute_terms={name: m * value for name, value in times[slowest].terms.items()})


def _optimizer_s(cfg: Config, device: Device, states: ModelStateBytes) -> float:
    # Adam's two fp32 moments per owned element (Muon's one momentum: bytes moved per element
    # are of the same order, its Newton-Schulz and gathers are muon_cost.py's)
    owned = states.optimizer // 8
    zero_and_clip = 3 * states.grads  # zero the fp32 gradients, read them for the norm, scale them
    return (ADAMW_BYTES * owned + zero_and_clip) / (device.memory_gbps * 1e9)


def tokens_per_s(cfg: Config, step: StepTime) -> float:
    return cfg.train.global_batch_size * cfg.train.seq_len / step.total


def ranks_evaluated(pp: int) -> List[int]:
    """The pipeline ranks whose memory and time bound a layout: the first (most micro-batches
    in flight, the embedding, the remainder layers), the second (the most in flight of the
    ranks holding both kinds of receive buffers, one per micro-batch in flight:
    trainer3d/parallel/pipeline/buffers.py) and the last (head, logits, loss). The dry run
    checks every rank."""
    return sorted({0, min(1, pp - 1), pp - 1})
