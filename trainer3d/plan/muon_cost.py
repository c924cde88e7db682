"""What ``optim.name=muon`` adds to a step (docs/optimizers.md, parallel/zero/muon.py): the
Newton-Schulz matmuls of every matrix of the rank's stages, run whole on every rank, and the
gathers that assemble those matrices.

Newton-Schulz on an m x n matrix (m <= n, the wide orientation it iterates in) costs per
iteration X X^T (2 m^2 n FLOPs), the quintic's A A (2 m^3) and its product with X (2 m^2 n);
``ns_steps`` iterations. ZeRO-1 with dp x cp > 1 all-gathers the fp32 look-ahead of the Muon
elements over dp x cp; tp all-gathers each tp-sharded matrix (4 bytes per element of it).
"""

from typing import List, Tuple

from trainer3d.config.schema import Config
from trainer3d.memory.states import model_shapes
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank
from trainer3d.plan.devices import Device
from trainer3d.plan.links import _link_gbps


def _gather_s(nbytes: float, n: int, gbps: float, latency_us: float) -> float:
    """A ring all-gather into ``nbytes`` (step_time.py's ``gather_s``, which imports this module)."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / (gbps * 1e9) + (n - 1) * latency_us * 1e-6


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on one rows x cols matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def rank_matrices(cfg: Config, pp_rank: int) -> List[Tuple[int, int]]:
    """The full (unsharded) shapes of the Muon matrices pipeline rank ``pp_rank`` holds, one
    entry per matrix (each expert's its own)."""
    p = cfg.parallel
    block = [s for s in model_shapes(cfg.model, 1).block if len(s) >= 2]
    per_block = [tuple(s[-2:]) for s in block for _ in range(s[0] if len(s) == 3 else 1)]
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), p.pp_layers)
    layers = sum(len(ranges[s]) for s in stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages))
    return per_block * layers


def muon_s(cfg: Config, device: Device, pp_rank: int, ranks_per_node: int) -> float:
    """Seconds pipeline rank ``pp_rank`` spends per step on Muon beyond AdamW's elementwise work:
    Newton-Schulz at the matmul rate of ``optim.muon.ns_dtype``, plus the dp and tp gathers."""
    if cfg.optim.name != "muon":
        return 0.0
    p, m = cfg.parallel, cfg.optim.muon
    shapes = rank_matrices(cfg, pp_rank)
    flops = sum(ns_flops(r, c, m.ns_steps) for r, c in shapes)
    tflops = device.matmul_tflops.get(m.ns_dtype) or device.matmul_tflops[cfg.train.dtype]
    seconds = flops / (tflops * 1e12)
    elements = sum(r * c for r, c in shapes)
    n = p.dp * p.cp
    lat = device.latency(min(ranks_per_node, p.tp * p.pp * n))
    if p.zero_stage == 1 and n > 1:
        gbps = _link_gbps(device, p.tp * n, ranks_per_node, min(n, max(1, ranks_per_node // p.tp)))
        seconds += _gather_s(4 * elements / p.tp, n, gbps, lat)
    if p.tp > 1:
        seconds += _gather_s(4 * elements, p.tp, _link_gbps(device, p.tp, ranks_per_node), lat)
    return seconds
