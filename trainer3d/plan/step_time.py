"""Predicted time of one training step of a validated layout on a Device.

Per micro-batch, on a pipeline rank (its chunks' blocks; the embedding on the first stage,
the final norm, head and loss on the last):

    forward  = matmul FLOPs / rate            2 x the matmul weights per token (PaLM's count,
                                              trainer3d/model/flops.py), attention scores
                                              counted causally (half of PaLM's 4sh)
             + elementwise bytes / bandwidth  norms, RoPE, SwiGLU, softmax: 2 passes over what
                                              the block saves (trainer3d/memory/activations.py)
             + tensor-parallel collectives    2 all-reduces per block (or all-gather +
                                              reduce-scatter, the same bytes) over intra-node links
             + context-parallel exchange      cp − 1 hops of a key/value block per block (backward:
                                              the blocks and their fp32 gradients, one more hop),
                                              each hidden behind one block's attention where it
                                              is shorter (ring attention, trainer3d/parallel/context/)
             + dispatch overhead              host time per block (CPUs)
    backward = 2 x the matmuls, 3 passes of elementwise traffic, the same collectives, and
               with recomputation the blocks' forward again

    step = (m + (p - 1) / v) x (slowest rank's forward + backward + 2 v hand-overs, each a
                                              send and the schedule's host time per action)
                                              the bubble: (p - 1) / (v m) of the compute
         + data-parallel reduction            bucketed, overlapped with the last micro-batch's
                                              backward except the last bucket; ZeRO-1's
                                              parameter all-gather, overlapped with the next
                                              first forward except the first bucket; FSDP2's
                                              un-overlapped share
         + optimizer                          AdamW over the owned elements, memory-bound
         + host                               the engine's own time per step outside the blocks
                                              (CPUs: measured by --calibrate; 0 on GPUs)

Ring collectives cost 2 (n-1)/n B / bandwidth + 2 (n-1) hops of latency (all-reduce), half
that for an all-gather or reduce-scatter (Patarasuk & Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations"). Where the ranks of a node share its
cores (CPUs) a step also takes at least the node's total work over the node's throughput
(``Device.node_rate``): the rank waiting in a bubble lends its core to the others.
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple

from trainer3d.memory.activations import FP32, Sizes, layer_terms
from trainer3d.config.schema import Config
from trainer3d.memory.states import BYTES, ModelStateBytes
from trainer3d.model.flops import layer_matmul_params
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank
from trainer3d.plan.devices import Device

FWD_PASSES, BWD_PASSES = 2, 3
ADAMW_BYTES = 36  # per owned element: read grad, moments, master/param; write moments, master/param (+16-bit copy)


def all_reduce_s(nbytes: float, n: int, gbps: float, latency_us: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / (gbps * 1e9) + 2 * (n - 1) * latency_us * 1e-6


def gather_s(nbytes: float, n: int, gbps: float, latency_us: float) -> float:
    """An all-gather into (or a reduce-scatter out of) ``nbytes``."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / (gbps * 1e9) + (n - 1) * latency_us * 1e-6


@dataclass
class RankTimes:
    """One micro-batch on one pipeline rank, seconds."""

    forward: float
    backward: float
    tp_comm: float


@dataclass
class StepTime:
    """Seconds of one step, by part; ``total`` is the prediction.

        compute     m micro-batches of the slowest rank (its tensor-parallel collectives included)
        tp_comm     the tensor-parallel share of compute
        bubble      pipeline fill and drain: (p - 1) / v slots of the slowest rank
        pp_comm     hand-overs between stages on the critical path
        dp_comm     data-parallel communication not hidden behind backward
        optimizer   AdamW over the owned elements, zeroing and clipping the gradients
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
    node_bound: float = 0.0
    host: float = 0.0

    @property
    def critical_path(self) -> float:
        return self.compute + self.bubble + self.pp_comm

    @property
    def total(self) -> float:
        return max(self.critical_path, self.node_bound) + self.dp_comm + self.optimizer + self.host


def _cp_exposed(cfg: Config, z: Sizes, device: Device, rate: float, lat: float,
                ranks_per_node: int) -> Tuple[float, float]:
    """(forward, backward) seconds per block of the ring's hops not hidden behind attention:
    a hop carries this rank's keys and values (backward: and their fp32 gradients) while one
    block of attention computes (a causal half-square of the local queries on local keys)."""
    p = cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0
    gbps = _link_gbps(device, p.tp * p.cp, ranks_per_node)
    kv = 2 * z.n * z.kv_heads // p.tp * z.head_dim
    hop = z.p * kv / (gbps * 1e9) + lat * 1e-6
    grad_hop = (z.p + FP32) * kv / (gbps * 1e9) + lat * 1e-6
    block_attention = 2 * z.n * z.s * z.heads // p.tp * z.head_dim / rate  # QK^T and PV, half of them masked
    fwd = (p.cp - 1) * max(0.0, hop - block_attention)
    bwd = (p.cp - 1) * max(0.0, grad_hop - 2 * block_attention) + FP32 * kv / (gbps * 1e9) + lat * 1e-6
    return fwd, bwd


def micro_batch_times(cfg: Config, device: Device, pp_rank: int, ranks_per_node: int) -> RankTimes:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    z = Sizes.of(cfg)
    speed = device.rank_speed(ranks_per_node)
    rate = device.matmul_tflops[t.dtype] * 1e12 * speed
    bw = (device.elementwise_gbps or device.memory_gbps) * 1e9 * speed
    hidden = z.p * z.n * z.h
    lat = device.latency(ranks_per_node)
    region = all_reduce_s(hidden, p.tp, device.intra_gbps, lat)  # one all-reduce, or AG + RS
    # a token attends over the whole sequence (t.seq_len) whichever cp rank holds it
    flops = z.n * (2 * layer_matmul_params(m) + 2 * t.seq_len * z.heads * z.head_dim) / p.tp
    saved = sum(layer_terms(z).values())
    overhead = device.layer_overhead_us * 1e-6 / speed
    cp_fwd, cp_bwd = _cp_exposed(cfg, z, device, rate, lat, ranks_per_node)
    block_fwd = flops / rate + FWD_PASSES * saved / bw + 2 * region + overhead / 3 + cp_fwd
    block_bwd = 2 * flops / rate + BWD_PASSES * saved / bw + 2 * region + 2 * overhead / 3 + cp_bwd
    if t.activation_checkpointing:
        block_bwd += block_fwd
    last = n_stages(cfg) - 1
    ranges = stage_layer_ranges(m.n_layers, last + 1, p.pp_layers)
    stages = stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages)
    layers = sum(len(ranges[s]) for s in stages)
    fwd, bwd = layers * block_fwd, layers * block_bwd
    tp = layers * (4 + 2 * t.activation_checkpointing) * region
    if 0 in stages:
        fwd += region
        tp += region
    if last in stages:
        head = 2 * z.n * z.h * z.vocab_local / rate
        logits = FP32 * z.n * z.vocab_local
        loss = 3 * all_reduce_s(FP32 * z.n, p.tp, device.intra_gbps, lat)
        fwd += head + 2 * logits / bw + loss
        bwd += 2 * head + 3 * logits / bw + region
        tp += loss + region
    return RankTimes(forward=fwd, backward=bwd, tp_comm=tp)


def _link_gbps(device: Device, span: int, ranks_per_node: int) -> float:
    """A group whose members lie ``span`` ranks apart end to end crosses nodes when wider than one."""
    return device.intra_gbps if span <= ranks_per_node else device.inter_gbps


def _dp_exposed(cfg: Config, device: Device, states: ModelStateBytes, times: RankTimes,
                ranks_per_node: int, backend: str) -> float:
    p, t = cfg.parallel, cfg.train
    n = p.dp * p.cp  # gradients are reduced, and ZeRO shards, over dp x cp
    if n == 1:
        return 0.0
    gbps = _link_gbps(device, p.tp * n, ranks_per_node)
    lat = device.latency(min(ranks_per_node, p.tp * p.pp * n))
    m = t.grad_accum_steps
    if p.zero_stage in (2, 3):
        params = states.params // FP32 * n  # the unsharded fp32 parameters FSDP2 gathers from
        b = BYTES[t.dtype]
        gather = gather_s(b * params, n, gbps, lat)
        scatter = gather_s(FP32 * params, n, gbps, lat)
        bwd_gather = gather if p.zero_stage == 3 else 0.0
        per_micro = max(0.0, gather - times.forward) + max(0.0, bwd_gather + scatter - times.backward)
        return m * per_micro + gather / (cfg.model.n_layers + 1)
    grads = states.grads
    scatter = p.zero_stage == 1 and backend == "nccl"
    reduce = gather_s(grads, n, gbps, lat) if scatter else all_reduce_s(grads, n, gbps, lat)
    bucket_share = min(1.0, p.bucket_mb * 2 ** 20 / max(1, grads))
    last_bucket = reduce * bucket_share
    exposed = last_bucket + max(0.0, reduce - last_bucket - times.backward)
    if p.zero_stage == 1:  # waited for bucket by bucket in the next first forward (parallel/zero/param_gather.py)
        gather = gather_s(states.params, n, gbps, lat)
        exposed += gather * bucket_share + max(0.0, gather * (1 - bucket_share) - times.forward)
    return exposed


def step_time(cfg: Config, device: Device, states: Dict[int, ModelStateBytes], ranks_per_node: int,
              backend: str = "nccl") -> StepTime:
    """``states``: model states of the pipeline ranks to time (at least the first and the
    last: the others differ only by the layers they hold, balanced by the stage split)."""
    p, t = cfg.parallel, cfg.train
    m, v = t.grad_accum_steps, p.pp_virtual_stages
    node_ranks = min(ranks_per_node, p.tp * p.cp * p.pp * p.dp)
    times: Dict[int, RankTimes] = {r: micro_batch_times(cfg, device, r, node_ranks) for r in states}
    slowest = max(times, key=lambda r: times[r].forward + times[r].backward)
    busy = times[slowest].forward + times[slowest].backward
    z = Sizes.of(cfg)
    hop = 0.0
    if p.pp > 1:
        gbps = _link_gbps(device, p.tp * p.cp * p.dp * p.pp, ranks_per_node)
        hop = z.hidden_bytes() / (gbps * 1e9) + (device.latency(node_ranks) + device.pipeline_action(node_ranks)) * 1e-6
    slot = busy + 2 * v * hop
    fill = (p.pp - 1) / v
    optimizer = max(_optimizer_s(cfg, device, s) for s in states.values())
    dp = max(_dp_exposed(cfg, device, s, times[r], ranks_per_node, backend) for r, s in states.items())
    # > 1 where the node's ranks share cores: their work, at one rank's speed alone, over the node's rate
    share = node_ranks * device.rank_speed(node_ranks) / device.node_rate(node_ranks)
    mean_compute = sum(m * (x.forward + x.backward) for x in times.values()) / len(times)
    return StepTime(compute=m * busy, tp_comm=m * times[slowest].tp_comm, bubble=fill * slot,
                    pp_comm=m * 2 * v * hop, dp_comm=share * dp, optimizer=share * optimizer,
                    node_bound=share * mean_compute if share > 1 else 0.0, host=device.step_overhead_us * 1e-6)


def _optimizer_s(cfg: Config, device: Device, states: ModelStateBytes) -> float:
    owned = states.optimizer // 8  # Adam's two fp32 moments per owned element
    zero_and_clip = 3 * states.grads  # zero the fp32 gradients, read them for the norm, scale them
    return (ADAMW_BYTES * owned + zero_and_clip) / (device.memory_gbps * 1e9)


def tokens_per_s(cfg: Config, step: StepTime) -> float:
    return cfg.train.global_batch_size * cfg.train.seq_len / step.total


def ranks_evaluated(pp: int) -> List[int]:
    """The pipeline ranks whose memory and time bound a layout: the first (most micro-batches
    in flight, the embedding, the remainder layers), the second (the most in flight of the
    ranks holding both kinds of receive buffers, which grow with the step's micro-batches)
    and the last (head, logits, loss). The dry run checks every rank."""
    return sorted({0, min(1, pp - 1), pp - 1})
