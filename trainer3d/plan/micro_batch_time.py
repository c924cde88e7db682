"""One micro-batch's forward and backward on one pipeline rank, by term: the part of the step-time
model (step_time.py) that the pipeline's slots and the data-parallel overlap are measured in.

A rank runs its chunks' blocks, the embedding on the first stage, the final norm, head and loss
on the last. Each block's forward and backward by term (block_time.py): on GPU presets its GEMMs
by shape, the attention kernel, elementwise traffic, tensor-parallel collectives and the host's
launches beyond the device's time (trainer3d/plan/kernels.py, with the published figures they
come from); on CPUs and calibrated machines the causal model FLOPs at the measured rate, the
elementwise traffic at the measured rate and the measured dispatch overhead. With recomputation
the backward runs the blocks' forward again. With context parallelism each block adds the
ring's exchange where it is longer than the attention it hides behind: cp − 1 hops of a
key/value block (backward: the blocks and their fp32 gradients, one more hop; ring attention,
trainer3d/parallel/context/).
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from trainer3d.config.schema import Config
from trainer3d.memory.activations import FP32, Sizes
from trainer3d.memory.rank_layout import model_key, rank_layout
from trainer3d.plan.block_time import BlockTime, all_reduce_s, block_time, tp_region_s
from trainer3d.plan.devices import Device
from trainer3d.plan.links import _link_gbps


@dataclass
class RankTimes:
    """One micro-batch on one pipeline rank, seconds."""

    forward: float
    backward: float
    tp_comm: float
    terms: Dict[str, float] = field(default_factory=dict)
    """forward + backward by term (block_time.py's, ``recompute``, ``head``)."""


def _cp_exposed(cfg: Config, z: Sizes, device: Device, ranks_per_node: int) -> Tuple[float, float]:
    """(forward, backward) seconds per block of the ring's hops not hidden behind attention:
    a hop carries this rank's keys and values (backward: and their fp32 gradients) while one
    block of attention computes (a causal half-square of the local queries on local keys): on
    GPU presets at the fused kernel's rate, as the ring runs torch's flash/memory-efficient
    kernels on CUDA (trainer3d/parallel/context/kernels.py ``block_kernel``)."""
    p = cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0
    rate = device.matmul_tflops[cfg.train.dtype] * 1e12 * device.rank_speed(ranks_per_node)
    lat = device.latency(ranks_per_node)
    gbps = _link_gbps(device, p.tp * p.cp, ranks_per_node)
    kv = 2 * z.n * z.kv_heads // p.tp * z.head_dim
    hop = z.p * kv / (gbps * 1e9) + lat * 1e-6
    grad_hop = (z.p + FP32) * kv / (gbps * 1e9) + lat * 1e-6
    if device.kernels is not None:  # GPU presets: the ring's blocks run torch's fused kernels (flash)
        block_attention = device.kernels.attention_s("flash", z.b, z.s, z.heads // p.tp, z.head_dim, z.p)[0]
    else:
        block_attention = 2 * z.n * z.s * z.heads // p.tp * z.head_dim / rate  # QK^T and PV, half masked
    fwd = (p.cp - 1) * max(0.0, hop - block_attention)
    bwd = (p.cp - 1) * max(0.0, grad_hop - 2 * block_attention) + FP32 * kv / (gbps * 1e9) + lat * 1e-6
    return fwd, bwd


BlockKey = Tuple[bool, str, str, int, str, Sizes]


def block_key(cfg: Config, z: Sizes, ranks_per_node: int, attention: str, moe: bool, model: str) -> BlockKey:
    """What ``_block`` reads of a layout on one device: the kind, the model (``model_key``), the
    attention kernel, the node's busy ranks, the dtype (the device's matmul rate) and ``Sizes``
    (micro-batch, sequence, tp, cp, sequence parallelism, ep, the model's widths)."""
    return moe, model, attention, ranks_per_node, cfg.train.dtype, z


def _block(cfg: Config, z: Sizes, device: Device, ranks_per_node: int, attention: str, moe: bool,
           blocks: Dict[BlockKey, BlockTime], model: str) -> BlockTime:
    """One block of the layout (an MoE block with ``moe``), with the ring's exposed exchange
    under context parallelism; kept in ``blocks`` (one device's) under ``block_key``."""
    key = block_key(cfg, z, ranks_per_node, attention, moe, model)
    if key not in blocks:
        block = block_time(cfg, device, ranks_per_node, attention, moe=moe)
        if cfg.parallel.cp > 1:
            block.fwd["cp_comm"], block.bwd["cp_comm"] = _cp_exposed(cfg, z, device, ranks_per_node)
        blocks[key] = block
    return blocks[key]


def micro_batch_times(cfg: Config, device: Device, pp_rank: int, ranks_per_node: int,
                      attention: str = "flash", blocks: Optional[Dict[BlockKey, BlockTime]] = None,
                      model: Optional[str] = None) -> RankTimes:
    """``blocks``: block times on ``device`` by ``block_key``, where another rank or layout has
    timed them (step_time.py passes one dict for all the ranks it times, the search one for
    all its layouts); ``model``: ``model_key(cfg)`` where the caller has it."""
    p, t = cfg.parallel, cfg.train
    blocks = {} if blocks is None else blocks
    model = model if model is not None else model_key(cfg)
    z = Sizes.of(cfg)
    region = tp_region_s(cfg, device, ranks_per_node)
    rank = rank_layout(cfg, pp_rank, model)
    stages, last = rank.stages, rank.last
    layers, experts = sum(rank.layers), sum(rank.moe)  # MoE blocks among them (plan/moe_cost.py)
    kinds = [(_block(cfg, z, device, ranks_per_node, attention, False, blocks, model), layers - experts)]
    if experts:
        kinds.append((_block(cfg, z, device, ranks_per_node, attention, True, blocks, model), experts))
    terms: Dict[str, float] = {}
    fwd = bwd = 0.0
    for kind, count in kinds:
        for name in {**kind.fwd, **kind.bwd}:  # dict order: a set's would vary with the string hash seed
            terms[name] = terms.get(name, 0.0) + count * (kind.fwd.get(name, 0.0) + kind.bwd.get(name, 0.0))
        fwd, bwd = fwd + count * kind.forward, bwd + count * kind.backward
    if t.activation_checkpointing:
        terms["recompute"] = fwd
        bwd += fwd
    tp = (layers * (4 + 2 * t.activation_checkpointing) - experts * (2 + t.activation_checkpointing)) * region
    if 0 in stages:
        fwd += region
        tp += region
        terms["tp_comm"] += region
    if last in stages:
        head_f, head_b = _head_s(cfg, device, z, ranks_per_node)
        lat = device.latency(ranks_per_node)
        loss = 3 * all_reduce_s(FP32 * z.n, p.tp, device.intra_gbps, lat)
        fwd += head_f + loss
        bwd += head_b + region
        tp += loss + region
        terms["head"] = head_f + head_b
        terms["tp_comm"] += loss + region
    return RankTimes(forward=fwd, backward=bwd, tp_comm=tp, terms=terms)


def _head_s(cfg: Config, device: Device, z: Sizes, ranks_per_node: int) -> Tuple[float, float]:
    """The output head's matmuls and the fp32 logits' elementwise passes (2 forward, 3 back)."""
    logits = FP32 * z.n * z.vocab_local
    if device.kernels is not None:
        f, b = device.kernels.linear_s(z.n, z.h, z.vocab_local, z.p)
        bw = device.kernels.hbm_gbps * 1e9
        return f + 2 * logits / bw, b + 3 * logits / bw
    speed = device.rank_speed(ranks_per_node)
    rate = device.matmul_tflops[cfg.train.dtype] * 1e12 * speed
    bw = (device.elementwise_gbps or device.memory_gbps) * 1e9 * speed
    head = 2 * z.n * z.h * z.vocab_local / rate
    return head + 2 * logits / bw, 2 * head + 3 * logits / bw
