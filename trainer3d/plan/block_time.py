"""One micro-batch through one transformer block (and the head), forward and backward, term by
term, on one tensor-parallel rank.

On a GPU preset (``Device.kernels``, trainer3d/plan/kernels.py):

    gemm         the block's seven linear layers (wq, wk, wv, wo, w1, w3, w2; tp-local
                 widths, the whole micro-batch's tokens: sequence parallelism gathers them
                 first), each forward and backward (input and weight gradients) by shape
    attention    the attention core by kernel (``cluster.attention``: flash or math)
    elementwise  norms, RoPE, SwiGLU, residuals: 2 passes forward, 3 backward over what
                 they write (``elementwise_bytes``) at the HBM rate
    tp_comm      2 all-reduces forward, 2 backward (or all-gather + reduce-scatter with
                 sequence parallelism: the same bytes) over the node's links
    launch       the host's dispatch time beyond the device's (kernels.py: a block takes the
                 longer of its kernels and their launches)

Elsewhere (CPUs, a calibration file) the block's matmuls run at the one measured rate and
its dispatch costs ``layer_overhead_us`` (micro_batch_time.py's docstring).
"""

from dataclasses import dataclass, field
from typing import Dict

from trainer3d.config.schema import Config
from trainer3d.memory.activations import FP32, Sizes
from trainer3d.model.flops import layer_matmul_params
from trainer3d.model.moe import ffn_params, moe_layer
from trainer3d.plan.devices import Device
from trainer3d.plan.kernels import block_ops
from trainer3d.plan.moe_cost import moe_block_terms

FWD_PASSES, BWD_PASSES = 2, 3


def all_reduce_s(nbytes: float, n: int, gbps: float, latency_us: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / (gbps * 1e9) + 2 * (n - 1) * latency_us * 1e-6


def elementwise_bytes(z: Sizes) -> int:
    """What a block's elementwise operators write in a forward, by the block's structure
    (model/transformer.py) rather than by what autograd keeps of it (recomputation and
    trainer3d/model/functional.py shrink that without making the operators cheaper):

        2 RMSNorms     an fp32 copy of the input and the normalised output (norm region)
        RoPE           q and k rotated
        attention      the kernel's output
        SwiGLU         silu(w1 x) and the product (reading w1 x and w3 x: 4 tensors of width f)
        residuals      2 adds (norm region)
    """
    region = z.n_norm * z.h
    q = z.n * (z.heads // z.t) * z.head_dim
    kv = z.n * (z.kv_heads // z.t) * z.head_dim
    ffn = z.n * (z.ffn // z.t)
    return 2 * (FP32 + z.p) * region + z.p * (q + kv) + z.p * q + 4 * z.p * ffn + 2 * z.p * region


@dataclass
class BlockTime:
    """Seconds of one block for one micro-batch, by term."""

    fwd: Dict[str, float] = field(default_factory=dict)
    bwd: Dict[str, float] = field(default_factory=dict)

    @property
    def forward(self) -> float:
        return sum(self.fwd.values())

    @property
    def backward(self) -> float:
        return sum(self.bwd.values())


def tp_region_s(cfg: Config, device: Device, ranks_per_node: int) -> float:
    """One tensor-parallel all-reduce of a hidden state (or all-gather + reduce-scatter)."""
    z = Sizes.of(cfg)
    return all_reduce_s(z.p * z.n * z.h, cfg.parallel.tp, device.intra_gbps, device.latency(ranks_per_node))


def block_time(cfg: Config, device: Device, ranks_per_node: int, attention: str = "flash",
               moe: bool = False) -> BlockTime:
    """One block, forward and backward (recomputation is the caller's: a second forward);
    ``moe``: a mixture-of-experts block (plan/moe_cost.py)."""
    z = Sizes.of(cfg)
    region = tp_region_s(cfg, device, ranks_per_node)
    if device.kernels is None:
        block = _measured_rate_block(cfg, device, ranks_per_node, region, moe)
    else:
        block = _kernel_block(cfg, device, z, region, attention)
    if moe:
        block = BlockTime(*moe_block_terms(cfg, device, ranks_per_node, z, block.fwd, block.bwd))
    return block


def _kernel_block(cfg: Config, device: Device, z: Sizes, region: float, attention: str) -> BlockTime:
    """A dense block by kernel on a GPU preset (the module docstring's terms)."""
    k, t = device.kernels, z.t
    linears = [(z.h, z.heads * z.head_dim // t), (z.h, z.kv_heads * z.head_dim // t),
               (z.h, z.kv_heads * z.head_dim // t), (z.heads * z.head_dim // t, z.h),
               (z.h, z.ffn // t), (z.h, z.ffn // t), (z.ffn // t, z.h)]
    gemm_f = gemm_b = 0.0
    for n_in, n_out in linears:
        f, b = k.linear_s(z.n, n_in, n_out, z.p)
        gemm_f, gemm_b = gemm_f + f, gemm_b + b
    # context parallelism: the local queries attend over the whole sequence (cp x the local
    # keys, load-balanced: trainer3d/data/cp_sharding.py), block by block through
    # torch's fused kernels on CUDA whatever SDPA would pick (parallel/context/kernels.py)
    kernel = "flash" if z.cp > 1 else attention
    attn_f, attn_b = k.attention_s(kernel, z.b, z.s, z.heads // t, z.head_dim, z.p)
    attn_f, attn_b = attn_f * z.cp, attn_b * z.cp
    saved = elementwise_bytes(z)
    bw = k.hbm_gbps * 1e9
    fwd = {"gemm": gemm_f, "attention": attn_f, "elementwise": FWD_PASSES * saved / bw, "tp_comm": 2 * region}
    bwd = {"gemm": gemm_b, "attention": attn_b, "elementwise": BWD_PASSES * saved / bw, "tp_comm": 2 * region}
    ops_f, ops_b = block_ops()
    fwd["launch"] = max(0.0, ops_f * k.launch_us * 1e-6 - sum(fwd.values()))
    bwd["launch"] = max(0.0, ops_b * k.launch_us * 1e-6 - sum(bwd.values()))
    return BlockTime(fwd, bwd)


def _block_flops(cfg: Config, z: Sizes, moe: bool) -> float:
    """Model FLOPs of one block's forward on this tp rank: its attention's weights and scores
    over t, and its feed-forward's (an MoE block's active weights: model/flops.py) over t for a
    dense block, over the tokens it routes for an MoE block (not split over tp)."""
    m = cfg.model
    ffn = 3 * m.dim * m.ffn_dim
    attention = layer_matmul_params(m, 0) - ffn_params(m, 0, active=True)
    scores = 2 * z.s * z.cp * z.heads * z.head_dim  # a token attends over the whole sequence whichever cp rank holds it
    if not moe:
        return z.n * (2 * (attention + ffn) + scores) / z.t
    first = next(i for i in range(m.n_layers) if moe_layer(m, i))
    return z.n * (2 * attention + scores) / z.t + z.n_norm * 2 * ffn_params(m, first, active=True)


def _measured_rate_block(cfg: Config, device: Device, ranks_per_node: int, region: float,
                         moe: bool = False) -> BlockTime:
    """A device known by one matmul rate (CPUs, calibration files): the causal model FLOPs
    over that rate, the elementwise traffic at the measured elementwise rate (calibrate.py
    measures it against the same ``elementwise_bytes``), and the
    measured per-block dispatch overhead (a third forward, two thirds backward)."""
    z = Sizes.of(cfg)
    speed = device.rank_speed(ranks_per_node)
    rate = device.matmul_tflops[cfg.train.dtype] * 1e12 * speed
    bw = (device.elementwise_gbps or device.memory_gbps) * 1e9 * speed
    flops = _block_flops(cfg, z, moe)
    saved = elementwise_bytes(z)
    overhead = device.layer_overhead_us * 1e-6 / speed
    fwd = {"gemm": flops / rate, "elementwise": FWD_PASSES * saved / bw, "tp_comm": 2 * region,
           "launch": overhead / 3}
    bwd = {"gemm": 2 * flops / rate, "elementwise": BWD_PASSES * saved / bw, "tp_comm": 2 * region,
           "launch": 2 * overhead / 3}
    return BlockTime(fwd, bwd)
