"""A rank's peak memory in a training step, term by term: the one accounting the dry run
(``dry_run=true``) prints and the planner (``python -m trainer3d.plan``) searches with.

    peak = model states        parameters, fp32 gradients, master weights, Adam moments
                               (trainer3d/memory/states.py, exact: tests/tools/test_zero_memory.py;
                               with parallel.offload_optimizer the masters and moments are
                               host memory, ``RankMemory.host``, outside the device's peak;
                               ZeRO-2/3 the parameter and gradient shards as well)
         + saved activations   what autograd keeps for backward, at the schedule's peak:
                               per micro-batch (trainer3d/memory/activations.py) x the micro-batches
                               in flight (trainer3d/memory/in_flight.py; tests/multirank/
                               test_activation_memory.py measures both)
         + pipeline buffers    receive buffers for the micro-batches in flight only: an input
                               activation per in-flight micro-batch and an output gradient
                               during a backward (trainer3d/parallel/pipeline/receive_count.py,
                               ``receive_buffers_held``, measured by tests/multirank/
                               test_pipeline.py), and each in-flight micro-batch's output kept
                               until its backward (torch's ``fwd_cache``); the first block's
                               saved input *is* the receive buffer (its norm keeps its input
                               as is, recomputation the block's)
         + the largest transient  the chunked loss's one chunk of logits (forward), or of the
                               backward: the loss gradient cast to 16-bit logits, a
                               recomputed block, a 16-bit parameter gradient before it is
                               added into the fp32 buffer, FSDP2's unsharded parameters and
                               gradients of one unit (an estimate: no CPU counterpart measures it),
                               or Muon's step: the largest matrix's tp gather and Newton-Schulz
                               buffers (trainer3d/memory/muon_step.py; at the step no activation
                               is held, so beside them it is an upper bound)

ZeRO-2/3 also have a start-up peak, while the model and optimizer are built: the shards and
the fill of one parameter, then the moments (trainer3d/memory/startup.py); ``total`` is the
larger of it and the step's.

Not counted: the framework's own buffers (CUDA context, NCCL, allocator fragmentation); the
planner keeps a per-device reserve for them. ZeRO 0/1 need no bucket buffers (buckets are
slices of the flat buffers, reduced and gathered in place).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from trainer3d.memory.bounded import Bounded
from trainer3d.memory.activations import (FP32, Sizes, chunk_terms, cp_document_pair_bytes, document_mask_terms,
                                          layer_terms, loss_transient_bytes, moe_layer_terms, shared_terms)
from trainer3d.memory.in_flight import in_flight
from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import zero_shards
from trainer3d.memory.moe import layout_model_state_bytes
from trainer3d.memory.muon_step import muon_step_bytes
from trainer3d.memory.rank_layout import RankLayout, model_key, rank_layout
from trainer3d.memory.staged import staged_bytes
from trainer3d.memory.startup import startup_bytes
from trainer3d.memory.states import BYTES, ModelShapes, ModelStateBytes
from trainer3d.parallel.pipeline.receive_count import receive_buffers_held


@dataclass
class RankMemory:
    """Peak bytes of one rank (tp rank 0, dp rank 0 of pipeline rank ``pp_rank``), by term."""

    pp_rank: int
    states: ModelStateBytes
    activations: Dict[str, int]
    buffers: Dict[str, int] = field(default_factory=dict)
    transients: Dict[str, int] = field(default_factory=dict)
    in_flight: List[int] = field(default_factory=list)
    """Micro-batches in flight on each of the rank's chunks at the peak."""
    startup: int = 0
    """ZeRO-2/3: device bytes at the start-up peak (trainer3d/memory/startup.py); 0 otherwise."""
    startup_host: int = 0
    """ZeRO-2/3: host bytes at the start-up peak (the offloaded shards, or one parameter's fill)."""
    startup_same_memory: int = 0
    """ZeRO-2/3 on CPU ranks, where host and device are one memory: the start-up peak."""
    staged: int = 0
    """Host bytes of a background checkpoint's copy of the rank's state (checkpoint.async_save,
    trainer3d/memory/staged.py), held from the first such save on; 0 without one."""

    @property
    def activation_bytes(self) -> int:
        return sum(self.activations.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(self.buffers.values())

    @property
    def transient_bytes(self) -> int:
        return max(self.transients.values(), default=0)

    @property
    def step_total(self) -> int:
        """Device bytes at the step's peak."""
        return self.states.total + self.activation_bytes + self.buffer_bytes + self.transient_bytes

    @property
    def total(self) -> int:
        """Device bytes at the peak: the step's, or start-up's where that is higher."""
        return max(self.step_total, self.startup)

    @property
    def host(self) -> int:
        """Host bytes of the offloaded optimizer state (0 without offload), at its peak."""
        return max(self.states.host, self.startup_host) if self.states.host else 0


_STATES: Bounded[ModelStateBytes] = Bounded(4096)


def _states_of(cfg: Config, rank: RankLayout, model: str) -> ModelStateBytes:
    """Model states of the rank's stages, cached on what they depend on (the planner asks
    often); ``model``: ``model_key(cfg)``."""
    p = cfg.parallel
    key = model + repr((p.tp, p.pp, p.pp_virtual_stages, p.pp_layers, zero_shards(p), p.zero_stage, p.bucket_mb,
                        cfg.train.dtype, list(rank.stages), p.offload_optimizer, cfg.optim.name, p.ep))
    return _STATES.get(key, lambda: _states(cfg, rank))


def _states(cfg: Config, rank: RankLayout) -> ModelStateBytes:
    p = cfg.parallel
    bucket = max(1, int(p.bucket_mb * 2 ** 20) // 4)
    # ZeRO shards over dp x cp (the gradient-reduction group, trainer3d/parallel/topology.py), HSDP over
    # dp_shard x cp; ep splits the expert weights (memory/moe.py)
    muon = list(rank.muon) if rank.muon is not None else None
    return layout_model_state_bytes(list(rank.params), list(rank.experts), p.ep, zero_shards(p), p.zero_stage,
                                    cfg.train.dtype, bucket, offload=p.offload_optimizer, muon=muon)


def rank_memory(cfg: Config, pp_rank: int, kernel: str = "flash", cuda: Optional[bool] = None,
                model: Optional[str] = None) -> RankMemory:
    """The peak of a validated config's pipeline rank ``pp_rank``, term by term; ``cuda``: the
    ranks run on CUDA (None: as the config says; trainer3d/memory/activations.py ``Sizes.of``);
    ``model``: ``model_key(cfg)`` where the caller has it (the search: once for all its layouts)."""
    p, t = cfg.parallel, cfg.train
    model = model if model is not None else model_key(cfg)
    rank = rank_layout(cfg, pp_rank, model)
    stages, last, m = list(rank.stages), rank.last, t.grad_accum_steps
    z = Sizes.of(cfg, kernel, cuda)
    recompute = t.activation_checkpointing
    chunks = [chunk_terms(z, n, s == 0, s == last, recompute, moe) for s, n, moe in zip(stages, rank.layers, rank.moe)]
    shared = [shared_terms(z, m, s == 0, s == last, p.pp) for s in stages]
    _, counts = in_flight(cfg, pp_rank, [sum(c.values()) for c in chunks], [sum(s.values()) for s in shared])
    activations: Dict[str, int] = {}
    for per_micro, per_step, n in zip(chunks, shared, counts):
        for name, value in per_micro.items():
            activations[name] = activations.get(name, 0) + n * value
        for name, value in per_step.items():  # kept while any of the chunk's micro-batches is in flight
            activations[name] = activations.get(name, 0) + (value if n else 0)
    mem = RankMemory(pp_rank=pp_rank, states=_states_of(cfg, rank, model), activations=activations,
                     in_flight=counts, staged=staged_bytes(cfg, pp_rank, model=model))
    if p.pp > 1:
        mem.buffers = _pipeline_buffers(cfg, z, pp_rank, stages, counts, last)
    mem.transients = _transients(cfg, z, stages, last, rank.shapes)
    muon = muon_step_bytes(cfg, sum(rank.layers))  # the dp group's largest
    if muon:
        mem.transients["muon_step"] = muon
    if p.zero_stage >= 2:
        mem.startup, mem.startup_host = startup_bytes(cfg, rank.params, mem.states, same_memory=False)
        mem.startup_same_memory = startup_bytes(cfg, rank.params, mem.states, same_memory=True)[0]
    return mem


def receive_buffer_bytes(cfg: Config, pp_rank: int) -> int:
    """The most bytes of receive buffers pp rank ``pp_rank`` holds at once in a step (one
    hidden state each, for the micro-batches in flight: parallel/pipeline/receive_count.py)."""
    return _receive_buffers(cfg, pp_rank) * Sizes.of(cfg).hidden_bytes()


def _receive_buffers(cfg: Config, pp_rank: int) -> int:
    p = cfg.parallel
    return receive_buffers_held(p.pp_schedule, p.pp, p.pp_virtual_stages, cfg.train.grad_accum_steps, pp_rank)


def _pipeline_buffers(cfg: Config, z: Sizes, pp_rank: int, stages: List[int], counts: List[int],
                      last: int) -> Dict[str, int]:
    hidden = z.hidden_bytes()  # a hidden state's bytes depend on no kernel: receive_buffer_bytes's
    receive = _receive_buffers(cfg, pp_rank) * hidden
    # the first block saves its input as is (its norm's x, or the whole input under
    # recomputation): counted as activations
    aliased = sum(n * hidden for s, n in zip(stages, counts) if s > 0)
    logits = z.p * z.n * z.vocab_local
    held = sum(n * (hidden if s < last or z.loss_chunk else logits) for s, n in zip(stages, counts))
    return {"pp_receive_buffers": max(0, receive - aliased), "pp_outputs_held": held}


def _transients(cfg: Config, z: Sizes, stages: List[int], last: int, shapes: ModelShapes) -> Dict[str, int]:
    p, t = cfg.parallel, cfg.train
    out: Dict[str, int] = {}
    if last in stages and z.loss_chunk:
        out["loss_chunk"] = loss_transient_bytes(z)
    elif last in stages and z.p != FP32:  # the loss's gradient is its saved fp32 softmax, made in
        out["loss_backward"] = z.p * z.n * z.vocab_local  # place; 16-bit logits take a cast of it
    if t.activation_checkpointing:
        block = max(sum(layer_terms(z).values()), sum(moe_layer_terms(z).values()) if z.moe else 0)
        out["recomputed_block"] = block - z.hidden_bytes()
        if z.documents:  # the micro-batch's mask, held by the blocks' Segments, not saved (model/documents.py)
            out.update(document_mask_terms(z))
    if z.documents and z.cp > 1:  # a chunk pair's mask and scores, one tile at a time
        out["cp_document_pair"] = cp_document_pair_bytes(z)
    if z.sp and z.t > 1:  # a projection's input gathered again in backward, and its gradient before the scatter
        out["sequence_parallel_regather"] = 2 * z.p * z.n * z.h
    b = BYTES[t.dtype]
    if p.zero_stage in (0, 1) and b != FP32:
        held = [*shapes.block, *shapes.moe_block, *(shapes.before if 0 in stages else ()), *(shapes.after if last in stages else ())]
        out["low_precision_grad"] = b * max(_numel(s) for s in held)
    if p.zero_stage in (2, 3):
        out["fsdp_unit"] = _fsdp_unit_bytes(cfg, b, shapes)
    return out


def _fsdp_unit_bytes(cfg: Config, b: int, shapes: ModelShapes) -> int:
    """FSDP2 shards every block and the root (embedding, final norm, head) as units: one
    unit's gradients unsharded (compute dtype, then fp32 for the reduce-scatter) and, for
    stage 3, its parameters gathered with the next unit's prefetched. Offloaded
    (parallel/zero/fsdp_offload.py): also the fp32 shards of those two units copied up for
    their all-gathers and the unit's scattered fp32 gradient shard before its copy down."""
    p = cfg.parallel
    block = max(sum(_numel(s) for s in shapes.block), sum(_numel(s) for s in shapes.moe_block))
    root = sum(_numel(s) for s in (*shapes.before, *shapes.after))
    unit = max(block, root)
    gathered = 2 * b * unit if p.zero_stage == 3 else 0
    copies = 3 * FP32 * -(-unit // zero_shards(p)) if p.offload_optimizer else 0
    return gathered + (b + FP32) * unit + copies


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
