"""What a mixture-of-experts block costs beyond the dense block, for the step-time model
(block_time.py, step_time.py).

Per MoE block and micro-batch on one rank, T the tokens it routes (s b, / t under sequence
parallelism: tensor parallelism leaves the block whole, parallel/tensor/layers.py), S = T k
routed slots (trainer3d/memory/moe.py ``MoESizes.slots``):

    gemm        the router (h -> E) over T tokens; the rank's E / ep experts as grouped GEMMs
                of ep S / E rows each (the balanced routing the aux loss aims at), three projections
                (h -> f, h -> f, f -> h); the shared experts (width f_s) over T tokens. The
                FLOPs are the active parameters' (model/flops.py), so FLOPs and MFU count what a
                token uses.
    elementwise the dense block's minus its SwiGLU, plus SwiGLU over S x f and T x f_s and the
                gather of the sorted tokens and the gate-weighted scatter back (S x h each)
    ep_comm     expert parallelism: two all-to-alls forward (dispatch, combine) and two backward,
                each moving (ep - 1) / ep of the S routed hidden states (memory/moe.py
                ``all_to_all_bytes``) over the ep group's links: ep members tp ranks apart,
                inside a node while tp x ep fits one (Megatron-Core's
                ``MoEAlltoAllTokenDispatcher``; DeepSpeed-MoE, Rajbhandari et al. 2022, sec. 5)

Gradients: with ep > 1 the expert weights' gradients reduce over dp x cp / ep ranks, the rest
over dp x cp (``expert_gradient_bytes`` splits a rank's gradient bytes).
"""

from math import prod
from typing import Dict, Tuple

from trainer3d.config.schema import Config
from trainer3d.memory.activations import Sizes
from trainer3d.memory.moe import all_to_all_bytes
from trainer3d.memory.bounded import Bounded
from trainer3d.memory.rank_layout import model_key, rank_layout
from trainer3d.memory.states import BYTES
from trainer3d.plan.devices import Device
from trainer3d.plan.links import _link_gbps


def moe_gemm_s(z: Sizes, device: Device) -> Tuple[float, float]:
    """(forward, backward) seconds of an MoE feed-forward's GEMMs on a GPU preset."""
    m, k = z.moe, device.kernels
    tokens = z.n_norm
    slots, local = m.slots(tokens), m.experts // m.ep
    rows = -(-slots * m.ep // m.experts)  # a local expert's share of the ep group's slots, balanced
    f, b = k.linear_s(tokens, z.h, m.experts, z.p)
    for n_in, n_out in ((z.h, m.ffn), (z.h, m.ffn), (m.ffn, z.h)):
        ef, eb = k.linear_s(rows, n_in, n_out, z.p)
        f, b = f + local * ef, b + local * eb
        if m.shared_ffn:
            width_in, width_out = (n_in, m.shared_ffn) if n_in == z.h else (m.shared_ffn, n_out)
            sf, sb = k.linear_s(tokens, width_in, width_out, z.p)
            f, b = f + sf, b + sb
    return f, b


def moe_elementwise_delta(z: Sizes) -> int:
    """Bytes an MoE block's elementwise operators write beyond the dense block's
    (block_time.py ``elementwise_bytes``): its SwiGLU replaced by the experts' and the shared
    experts', plus the tokens gathered in expert order and their gated scatter back."""
    m = z.moe
    tokens = z.n_norm
    slots = m.slots(tokens)
    dense_swiglu = 4 * z.p * z.n * (z.ffn // z.t)
    return 4 * z.p * (slots * m.ffn + tokens * m.shared_ffn) + 2 * z.p * slots * z.h - dense_swiglu


def all_to_all_s(cfg: Config, device: Device, ranks_per_node: int) -> float:
    """One of an MoE block's all-to-alls on one rank (0 without expert parallelism): the bytes
    bound for the other ep - 1 ranks over the ep group's link, and ep - 1 exchanges' latency."""
    p = cfg.parallel
    if p.ep == 1:
        return 0.0
    z = Sizes.of(cfg)
    nbytes = all_to_all_bytes(z.moe, z.n_norm, z.p, z.h)
    gbps = _link_gbps(device, p.tp * p.ep, ranks_per_node, max(1, min(p.ep, ranks_per_node // p.tp)))
    return nbytes / (gbps * 1e9) + (p.ep - 1) * device.latency(min(ranks_per_node, p.tp * p.ep)) * 1e-6


def moe_block_terms(cfg: Config, device: Device, ranks_per_node: int, z: Sizes,
                    dense_fwd: Dict[str, float], dense_bwd: Dict[str, float]) -> Tuple[Dict[str, float], Dict[str, float]]:
    """An MoE block's (forward, backward) terms from the dense block's: the gemm term's
    feed-forward swapped for the MoE one, elementwise adjusted, and ep_comm."""
    fwd, bwd = dict(dense_fwd), dict(dense_bwd)
    # the feed-forward is not split over tp: only attention's region communicates (one each way)
    fwd["tp_comm"], bwd["tp_comm"] = fwd["tp_comm"] / 2, bwd["tp_comm"] / 2
    if device.kernels is not None:
        k = device.kernels
        dense_f = dense_b = 0.0
        for n_in, n_out in ((z.h, z.ffn // z.t), (z.h, z.ffn // z.t), (z.ffn // z.t, z.h)):
            f, b = k.linear_s(z.n, n_in, n_out, z.p)
            dense_f, dense_b = dense_f + f, dense_b + b
        moe_f, moe_b = moe_gemm_s(z, device)
        fwd["gemm"] += moe_f - dense_f
        bwd["gemm"] += moe_b - dense_b
        bw = k.hbm_gbps * 1e9
    else:
        speed = device.rank_speed(ranks_per_node)
        bw = (device.elementwise_gbps or device.memory_gbps) * 1e9 * speed
    delta = moe_elementwise_delta(z)
    fwd["elementwise"] += 2 * delta / bw
    bwd["elementwise"] += 3 * delta / bw
    a2a = all_to_all_s(cfg, device, ranks_per_node)
    if a2a:
        fwd["ep_comm"], bwd["ep_comm"] = 2 * a2a, 2 * a2a
    return fwd, bwd


def expert_gradient_bytes(cfg: Config, pp_rank: int, grads: int) -> Tuple[int, int]:
    """(non-expert, expert) fp32 gradient bytes of ``pp_rank``'s ``grads``: with ep > 1 the
    experts' reduce over dp x cp / ep ranks, the rest over dp x cp (trainer3d/memory/moe.py
    ``layout_model_state_bytes``); without it all of ``grads`` is one reduction."""
    p = cfg.parallel
    if p.ep == 1 or cfg.model.moe.num_experts == 0:
        return grads, 0
    key = model_key(cfg) + repr((p.tp, p.pp, p.pp_virtual_stages, p.pp_layers, p.pp_schedule, p.ep, pp_rank))
    experts = _EXPERT_BYTES.get(key, lambda: _expert_bytes(cfg, pp_rank))
    return max(0, grads - experts), experts


_EXPERT_BYTES: Bounded[int] = Bounded(4096)
"""``_expert_bytes`` by model and layout (the search asks for every layout it tries)."""


def _expert_bytes(cfg: Config, pp_rank: int) -> int:
    """fp32 gradient bytes of ``pp_rank``'s expert weights on one ep rank: the stages the rank
    runs under its schedule (a V's r and 2 pp - 1 - r: trainer3d/memory/rank_layout.py)."""
    layout = rank_layout(cfg, pp_rank)
    experts = sum(prod(shape) // cfg.parallel.ep for shape, expert in zip(layout.params, layout.experts) if expert)
    return experts * BYTES["fp32"]
