"""Memory of mixture-of-experts blocks (model/moe.py): their saved activations and, with
expert parallelism, their model states.

Saved per MoE block for one micro-batch, T = the tokens the block routes on this rank (the
micro-batch's s b, / t under sequence parallelism: the block is not split over tp), S = the
routed slots (T k dropless; with ``capacity_factor`` at most E x capacity, charged as that
bound), R = the slots this rank's experts compute (S without expert parallelism), p the
activation bytes; each storage once, as ``saved_tensors_hooks`` see it
(tests/unit/test_memory_moe.py holds each term to the meter):

    router_scores   4 T E        softmax (or sigmoid) output, fp32 (softmax/sigmoid backward, the gather)
    routing         8 T k + 4 T k + 4 T    top-k indices (int64), the chosen scores and their sum (fp32,
                                 the renormalising division's operands)
    slot_order      2 x 8 S      the slots sorted by expert and their tokens (int64: the gather of x,
                                 the gates and index_add_ keep them)
    dispatched      p R h        the tokens sorted by expert (the grouped matmul's input; with ep the
                                 dispatching all-to-all's output)
    experts         2 p R f + 8 E/ep    w1 x and w3 x (model/experts.py) and the experts' token counts
    combine         2 p S h + p S        the experts' outputs (with ep the returning all-to-all's
                                 output), their gate-weighted copy index_add_ keeps, the gates column
    ep_order        8 R          with ep: the permutation of the received slots into expert order
                                 (int64; the dispatching and the combining all-to-all keep the one tensor)
    shared          2 p T f_s    the shared experts' w1 x and w3 x (their input is the block's, counted)
    aux_loss        4 E (+ 4 T)  the expert shares f (sigmoid_topk: the scores' row sums)
    z_loss          4 T E + 4 T  fp32 logits and their logsumexp

The block's input (the ffn norm's output, what the router and shared experts read) is the
dense block's ``ffn_input`` term.

Tokens per expert are data-dependent, but without expert parallelism a rank computes exactly
S = T k slots (dropless), whatever the routing: the estimate is exact. With ep > 1 the slots a
rank's experts receive depend on the routing of every rank in the ep group: the estimate
charges the balanced expectation R = S (each rank receives, on average, as many slots as it
sends); ``received_slots(worst=True)`` is the dropless worst case, every rank's tokens routed
to this rank's experts (ep S, at most min(k, E / ep) slots per token), which the dry run prints
beside it.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from trainer3d.config.schema import Config
from trainer3d.memory.states import ModelStateBytes, engine_model_state_bytes, model_shapes
from trainer3d.model.moe import expert_ffn_dim, moe_layer
from trainer3d.parallel.pipeline.placement import holds_embedding
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank
from trainer3d.parallel.topology import Topology

INT64, FP32 = 8, 4


@dataclass(frozen=True)
class MoESizes:
    """What an MoE block's saved activations depend on, beside the dense block's ``Sizes``."""

    experts: int
    top_k: int
    ffn: int
    """One routed expert's SwiGLU width."""
    shared_ffn: int
    """The shared experts' width together (0 without them)."""
    sigmoid: bool
    aux_loss: bool
    z_loss: bool
    capacity_factor: float = 0.0
    ep: int = 1

    @classmethod
    def of(cls, cfg: Config) -> Optional["MoESizes"]:
        moe = cfg.model.moe
        if moe.num_experts == 0:
            return None
        f = expert_ffn_dim(cfg.model)
        return cls(experts=moe.num_experts, top_k=moe.top_k, ffn=f, shared_ffn=moe.num_shared_experts * f,
                   sigmoid=moe.router == "sigmoid_topk", aux_loss=moe.balance == "aux_loss" and moe.aux_loss_coef > 0,
                   z_loss=moe.z_loss_coef > 0, capacity_factor=moe.capacity_factor, ep=cfg.parallel.ep)

    def slots(self, tokens: int) -> int:
        """Routed slots of ``tokens`` tokens: T k dropless; with a capacity, at most E x capacity
        (model/moe.py ``_drop_over_capacity``), the bound charged."""
        routed = tokens * self.top_k
        if self.capacity_factor > 0:
            capacity = int(-(-self.capacity_factor * tokens * self.top_k // self.experts))
            return min(routed, self.experts * capacity)
        return routed

    def received_slots(self, tokens: int, worst: bool = False) -> int:
        """Slots this rank's experts compute: all of the rank's own without ep; with ep the
        balanced expectation (as many as it sends), or (``worst``) every ep rank's tokens sent
        to this rank's E / ep experts, min(k, E / ep) slots each."""
        if self.ep == 1 or not worst:
            return self.slots(tokens)
        return min(self.ep * self.slots(tokens), self.ep * tokens * min(self.top_k, self.experts // self.ep))


def moe_ffn_terms(m: MoESizes, tokens: int, p: int, h: int, worst: bool = False) -> Dict[str, int]:
    """Saved bytes of one MoE feed-forward for ``tokens`` routed tokens (the module docstring's
    table); ``worst``: the dropless worst case of the slots an ep rank receives."""
    t, e, k = tokens, m.experts, m.top_k
    s, r = m.slots(t), m.received_slots(t, worst)
    terms = {
        "router_scores": FP32 * t * e,
        "routing": INT64 * t * k + FP32 * t * k + FP32 * t,
        "slot_order": 2 * INT64 * s,
        "dispatched": p * r * h,
        "experts": 2 * p * r * m.ffn + INT64 * (e // m.ep),
        "combine": 2 * p * s * h + p * s,
    }
    if m.ep > 1:
        terms["ep_order"] = INT64 * r
    if m.shared_ffn:
        terms["shared_experts"] = 2 * p * t * m.shared_ffn
    if m.aux_loss:
        terms["aux_loss"] = FP32 * e + (FP32 * t if m.sigmoid else 0)
    if m.z_loss:
        terms["z_loss"] = FP32 * t * e + FP32 * t
    return terms


def all_to_all_bytes(m: MoESizes, tokens: int, p: int, h: int) -> int:
    """Bytes one rank sends (and receives, balanced) in one of an MoE block's four all-to-alls
    (dispatch and combine, forward and backward): its routed slots' hidden states bound for
    the other ep - 1 ranks, (ep - 1) / ep of S p h (0 without ep)."""
    return m.slots(tokens) * p * h * (m.ep - 1) // m.ep


# ------------------------------------------------------------------ model states under ep

def moe_layers(cfg: Config, stage: int) -> int:
    """MoE blocks of pipeline ``stage``."""
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), cfg.parallel.pp_layers)
    return sum(moe_layer(cfg.model, i) for i in ranges[stage])


def stage_expert_mask(cfg: Config, stage: int) -> List[bool]:
    """Which of ``stage_parameter_shapes(cfg, stage)`` are expert weights (3-D, split by ep)."""
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), cfg.parallel.pp_layers)
    shapes = model_shapes(cfg.model, cfg.parallel.tp)
    last = len(ranges) - 1
    before = holds_embedding(stage, len(ranges), cfg.model.tie_embeddings, cfg.parallel.pp, cfg.parallel.pp_schedule)
    return [*([False] * len(shapes.before) if before else ()),
            *(x for i in ranges[stage] for x in shapes.layer_experts(cfg.model, i)),
            *([False] * len(shapes.after) if stage == last else ())]


def rank_expert_mask(cfg: Config, rank: int) -> List[bool]:
    """``stage_expert_mask`` of every stage global ``rank`` holds."""
    p = cfg.parallel
    pp_rank = Topology.of(p).coords(rank).pp
    return [x for stage in stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages) for x in stage_expert_mask(cfg, stage)]


def _add(a: ModelStateBytes, b: ModelStateBytes) -> ModelStateBytes:
    return ModelStateBytes(**{k: getattr(a, k) + getattr(b, k) for k in vars(a)})


def layout_model_state_bytes(shapes: Sequence[Tuple[int, ...]], experts: Sequence[bool], ep: int, shards: int,
                             stage: int, dtype: str, bucket_numel: int, dp_rank: int = 0, offload: bool = False,
                             muon: Optional[Sequence[bool]] = None) -> ModelStateBytes:
    """Model states of a rank holding ``shapes`` (its 1-ep-rank shapes; ``experts`` marks the
    expert weights) with its ZeRO state over ``shards`` ranks (dp x cp).

    ep = 1: one flat buffer of everything (``engine_model_state_bytes``). ep > 1 (Megatron-Core's
    expert-data-parallel scheme, megatron/core/distributed/distributed_data_parallel.py keeps
    expert parameters in buffers of their own): the non-expert parameters as before over
    ``shards``; the rank's E / ep experts of each expert weight in a second flat buffer whose
    gradients and ZeRO-1 shards are over the expert-data-parallel group, shards / ep ranks,
    with its own step counter."""
    if ep == 1:
        return engine_model_state_bytes(list(shapes), shards, stage, dtype, bucket_numel, dp_rank, offload, muon)
    dense = [s for s, x in zip(shapes, experts) if not x]
    local = [(s[0] // ep, *s[1:]) for s, x in zip(shapes, experts) if x]
    muon_dense = [m for m, x in zip(muon, experts) if not x] if muon is not None else None
    muon_local = [m for m, x in zip(muon, experts) if x] if muon is not None else None
    out = engine_model_state_bytes(dense, shards, stage, dtype, bucket_numel, dp_rank, offload, muon_dense)
    if local:
        out = _add(out, engine_model_state_bytes(local, shards // ep, stage, dtype, bucket_numel,
                                                 dp_rank % (shards // ep), offload, muon_local))
    return out

