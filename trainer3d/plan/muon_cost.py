"""What ``optim.name=muon`` adds to a step (docs/optimizers.md, parallel/zero/muon.py): the
Newton-Schulz matmuls of the matrices a rank orthogonalises, and the collectives that assemble
those matrices and hand the results back.

Newton-Schulz on an m x n matrix (m <= n, the wide orientation it iterates in) costs per
iteration X X^T (2 m^2 n FLOPs), the quintic's A A (2 m^3) and its product with X (2 m^2 n);
``ns_steps`` iterations. A rank orthogonalises every matrix of its stages, or under ZeRO-1
with dp x cp > 1 and ``optim.muon.layer_wise`` its share (``ns_shares``, the engine's own
assignment); the step waits for the dp group's largest share. ZeRO-1 with dp x cp > 1
all-gathers the fp32 look-ahead of the Muon elements over dp x cp, and layer-wise the owners'
results come back by broadcasts of the same volume (each rank receives the matrices it did not
orthogonalise, charged as that all-gather); tp all-gathers each tp-sharded matrix (4 bytes per
element of it).
"""

from trainer3d.config.schema import Config
from trainer3d.memory.muon_step import layer_wise, ns_shares, rank_muon_params
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank
from trainer3d.parallel.zero.muon import ns_cost, ns_flops
from trainer3d.plan.devices import Device
from trainer3d.plan.links import _link_gbps, gather_s

__all__ = ["muon_s", "ns_flops", "rank_layers"]


def rank_layers(cfg: Config, pp_rank: int) -> int:
    """The blocks pipeline rank ``pp_rank``'s stages hold."""
    p = cfg.parallel
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), p.pp_layers)
    return sum(len(ranges[s]) for s in stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule))


def muon_s(cfg: Config, device: Device, pp_rank: int, ranks_per_node: int) -> float:
    """Seconds pipeline rank ``pp_rank`` spends per step on Muon beyond AdamW's elementwise work:
    Newton-Schulz at the matmul rate of ``optim.muon.ns_dtype`` (the dp group's largest share),
    plus the dp gathers and broadcasts and the tp gathers."""
    if cfg.optim.name != "muon":
        return 0.0
    p, m = cfg.parallel, cfg.optim.muon
    params = rank_muon_params(cfg, rank_layers(cfg, pp_rank))
    flops = max(sum(ns_cost(shape, sharded, m.ns_steps)[0] for shape, sharded in share)
                for share in ns_shares(cfg, params))
    tflops = device.matmul_tflops.get(m.ns_dtype) or device.matmul_tflops[cfg.train.dtype]
    seconds = flops / (tflops * 1e12)
    elements = sum(ns_cost(shape, sharded, m.ns_steps)[1] for shape, sharded in params)
    n = p.dp * p.cp
    lat = device.latency(min(ranks_per_node, p.tp * p.pp * n))
    if p.zero_stage == 1 and n > 1:
        gbps = _link_gbps(device, p.tp * n, ranks_per_node, min(n, max(1, ranks_per_node // p.tp)))
        rounds = 2 if layer_wise(cfg) else 1  # the look-ahead's gather, and the results' broadcasts
        seconds += rounds * gather_s(4 * elements / p.tp, n, gbps, lat)
    if p.tp > 1:
        seconds += gather_s(4 * elements, p.tp, _link_gbps(device, p.tp, ranks_per_node), lat)
    return seconds
