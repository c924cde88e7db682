"""Model-state memory per rank: the ZeRO paper's accounting, and what this engine allocates.

Model states are parameters, gradients and optimizer states (Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3.1);
activations and temporary buffers are not counted here. Ψ is the number of parameters a
rank's model replica holds (all of them when tp = pp = 1), N the dp degree.

The paper (sec. 5.1, Table 1) trains with mixed-precision Adam: 2Ψ bytes of fp16
parameters, 2Ψ of fp16 gradients and KΨ of optimizer state (K = 12: fp32 master weights,
momentum, variance), so per rank

    stage 0 (plain DP)      (2 + 2 + K) Ψ
    stage 1 (P_os)          2Ψ + 2Ψ + KΨ/N
    stage 2 (P_os+g)        2Ψ + (2 + K) Ψ/N
    stage 3 (P_os+g+p)      (2 + 2 + K) Ψ/N

This engine allocates, term by term (``engine_model_state_bytes``; b = 2 for bf16/fp16,
L = the flat buffer's padded length, S = N x the per-parameter padded shard length,
S' = N x the rank's unpadded shard length):

    stage   parameters   gradients   fp32 master      Adam moments
    0       bΨ | 4Ψ      4Ψ          4Ψ | none        8Ψ
    1       bL | 4L      4L          4L/N | none      8L/N
    2       4S/N + bS    4S/N        (the 4S/N)       8S'/N
    3       4S/N         4S/N        (the 4S/N)       8S'/N

(first of a pair: bf16/fp16 training; second: fp32) plus 4 bytes of step counter and, for
fp16, 16 bytes of loss-scaler state. Why each term differs from the paper's:

- gradients are 4 bytes, not 2: micro-batch gradients are accumulated and reduced over dp
  in an fp32 buffer (Megatron-LM's choice for bf16: summing many micro-batches and ranks
  in 16 bits loses small updates). That is +2Ψ for stages 0/1, +2Ψ/N for 2. Stage 3
  comes out equal to the paper's 16Ψ/N: it keeps no 16-bit parameter shard (FSDP2 casts
  while gathering), which gives those 2Ψ/N back. The low-precision ``.grad`` of one
  parameter lives only until its hook adds it into the fp32 buffer.
- fp32 training needs no master copy: the fp32 parameters are the master weights (stage 0:
  4Ψ + 4Ψ + 8Ψ = 16Ψ, the paper's total with every term in 4-byte words). Stages 2/3 keep fp32 shards as the parameters themselves
  and FSDP2 all-gathers a compute-dtype copy: stage 2 holds it for the whole forward and
  backward (the paper's replicated 2Ψ; 4Ψ in fp32), stage 3 one block at a time (not counted).
- padding: stage 1 pads each gradient bucket to a multiple of N so every rank owns an equal
  slice (L - Ψ < N per bucket); FSDP2 gives every rank ceil(rows/N) rows of each parameter.
- no bucket buffers: buckets are slices of the flat buffers, reduced and gathered in place.

With ``parallel.offload_optimizer`` (docs/offload.md) state moves to host memory (``host``):
stages 0/1 the owned masters and moments, with an fp32 gradient copy (16 bytes per owned
element, + b for the cast back); stages 2/3 everything but ZeRO-2's gathered bS — the
parameter shard 4S/N, the gradient shard 4S/N and the moments 8S'/N. (The gradient shard is
a view of the padded reduce-scatter output where host and device are one memory; a CUDA
rank copies down only its real rows, up to N - 1 rows per parameter less.)
"""

import copy
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.model.moe import moe_layer
from trainer3d.parallel.parallelize import build_meta_chunks
from trainer3d.parallel.zero.buckets import plan_buckets
from trainer3d.parallel.pipeline.placement import holds_embedding
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank
from trainer3d.parallel.topology import ParallelDims, Topology

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STEP_BYTES = 4          # the fp32 step counter
FP16_SCALER_BYTES = 16  # scale, last used scale, growth tracker, found_inf

Shapes = Union[int, Sequence[Tuple[int, ...]]]


def paper_model_state_bytes(psi: float, dp: int, stage: int, k: int = 12) -> float:
    """Bytes per rank by the ZeRO paper's formulas (mixed precision, K bytes/param optimizer)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / dp
    if stage == 2:
        return 2 * psi + (2 + k) * psi / dp
    if stage == 3:
        return (2 + 2 + k) * psi / dp
    raise ValueError(f"zero stage {stage}")


@dataclass(frozen=True)
class ModelStateBytes:
    """This engine's model-state bytes on one rank, by term (see the module docstring)."""

    params: int
    grads: int
    master: int
    optimizer: int
    """Adam's exp_avg and exp_avg_sq, the step counter and (fp16) the loss scaler."""
    gathered: int = 0
    """ZeRO-2's full compute-dtype parameters, held from forward until backward ends."""
    host: int = 0
    """Optimizer offload: the state in host memory (fp32 masters, moments and gradient copy,
    the cast parameters on their way back, the step counter); not part of ``total``."""
    offloaded: int = 0
    """Optimizer offload: the owned elements whose state and step are on the host."""
    sharded: int = 0
    """Stages 2/3: the elements of this rank's padded parameter shard (FSDP2), wherever they
    live (what the all-gathers and reduce-scatters move, times the dp degree)."""

    @property
    def total(self) -> int:
        """Bytes on the device."""
        return self.params + self.grads + self.master + self.optimizer + self.gathered


def _shapes(shapes: Shapes) -> List[Tuple[int, ...]]:
    return [(int(shapes),)] if isinstance(shapes, (int, float)) else [tuple(s) for s in shapes]


def _owned_by_kind(numels: Sequence[int], muon: Sequence[bool], plan, dp: int, dp_rank: int) -> Tuple[int, int]:
    """(AdamW's, Muon's) elements in ``dp_rank``'s owned slices of the buckets (padding in neither),
    ``numels`` and ``muon`` in flat order."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    owned = [0, 0]
    for start, end, members in plan:
        size = (end - start) // dp
        lo, hi = start + dp_rank * size, start + (dp_rank + 1) * size
        for i in members:
            owned[bool(muon[i])] += max(0, min(hi, offsets[i + 1]) - max(lo, offsets[i]))
    return owned[0], owned[1]


def engine_model_state_bytes(shapes: Shapes, dp: int, stage: int, dtype: str,
                             bucket_numel: int = 25 * 2 ** 20 // 4, dp_rank: int = 0,
                             offload: bool = False, muon: Optional[Sequence[bool]] = None) -> ModelStateBytes:
    """What this engine allocates per rank for parameters of ``shapes`` (this rank's model
    replica, in registration order; an int Ψ stands for one flat tensor of Ψ elements).

    ``bucket_numel`` is ``parallel.bucket_mb`` in fp32 elements (it sets stage 1's padding).
    ``dp_rank`` matters for stages 2/3 only: FSDP2 keeps parameter and gradient shards padded
    to ceil(rows/N) rows, but the moments cover the rank's real rows (rank 0 has the most).
    ``offload``, stages 0/1 (parallel/zero/offload.py): the device keeps the parameters, the
    fp32 gradient buckets and fp16's scaler; the host the owned elements' fp32 masters, moments
    and gradient copy (16 bytes each), their cast for the way back (bf16/fp16: b more) and the
    step counter. Stages 2/3 (parallel/zero/fsdp_offload.py, FSDP2's CPUOffloadPolicy): the
    host the padded fp32 parameter and gradient shards (4S/N each), the moments (8S'/N) and
    the step counter; the device ZeRO-2's gathered
    parameters and fp16's scaler (what is in flight is a transient: memory/peak.py).
    ``muon`` (``optim.name=muon``, stages 0/1): which of ``shapes`` Muon trains; those owned
    elements hold one fp32 momentum (4 bytes) instead of Adam's two moments (8), and masters
    and state cover the owned parameter elements only, not the buckets' padding
    (parallel/zero/muon.py).
    """
    shapes, b = _shapes(shapes), BYTES[dtype]
    scalars = STEP_BYTES + (FP16_SCALER_BYTES if dtype == "fp16" else 0)
    if stage in (0, 1):
        numels = [prod(s) for s in reversed(shapes)]  # the flat buffer's (backward) order
        _, _, flat = plan_buckets(numels, bucket_numel, dp if stage == 1 else 1)
        owned = flat // dp if stage == 1 else flat
        if offload:
            host = (16 + (b if b != 4 else 0)) * owned + STEP_BYTES
            return ModelStateBytes(params=b * flat, grads=4 * flat, master=0, optimizer=scalars - STEP_BYTES,
                                   host=host, offloaded=owned)
        if muon is not None:
            plan = plan_buckets(numels, bucket_numel, dp if stage == 1 else 1)[1]
            rest, matrices = _owned_by_kind(numels, list(reversed(muon)), plan, dp if stage == 1 else 1,
                                            dp_rank if stage == 1 else 0)
            return ModelStateBytes(params=b * flat, grads=4 * flat, master=4 * (rest + matrices) if b != 4 else 0,
                                   optimizer=8 * rest + 4 * matrices + scalars)
        master = 4 * owned if b != 4 else 0
        return ModelStateBytes(params=b * flat, grads=4 * flat, master=master, optimizer=8 * owned + scalars)
    if stage in (2, 3):
        rows = [-(-s[0] // dp) for s in shapes]
        shard = sum(r * prod(s[1:]) for r, s in zip(rows, shapes))
        real = sum(min(r, max(0, s[0] - dp_rank * r)) * prod(s[1:]) for r, s in zip(rows, shapes))
        gathered = b * dp * shard if stage == 2 else 0  # the all-gather's output, padded rows included
        if offload:
            return ModelStateBytes(params=0, grads=0, master=0, optimizer=scalars - STEP_BYTES, gathered=gathered,
                                   host=8 * shard + 8 * real + STEP_BYTES, offloaded=real, sharded=shard)
        return ModelStateBytes(params=4 * shard, grads=4 * shard, master=0, optimizer=8 * real + scalars,
                               gathered=gathered, sharded=shard)
    raise ValueError(f"zero stage {stage}")


# ------------------------------------------------------------------ the shapes a rank holds

def planning_dims(cfg: Config, rank: int) -> ParallelDims:
    """The ParallelDims of ``rank`` without process groups (for building shapes on meta)."""
    p = cfg.parallel
    topo = Topology.of(p)
    return ParallelDims(topo=topo, rank=rank, mesh=None, tp_group=None, dp_group=None, pp_group=None,
                        device=torch.device("meta"))


Shape = Tuple[int, ...]


@dataclass(frozen=True)
class ModelShapes:
    """One tp rank's parameter shapes in registration order: what is registered before the
    blocks (the embedding), a dense block, what comes after them (final norm, head), and for a
    mixture-of-experts model an MoE block with which of its parameters are experts (the 3-D
    weights expert parallelism splits: model/moe.py ``Experts``)."""

    before: Tuple[Shape, ...]
    block: Tuple[Shape, ...]
    after: Tuple[Shape, ...]
    moe_block: Tuple[Shape, ...] = ()
    moe_experts: Tuple[bool, ...] = ()

    def layer(self, model: ModelConfig, index: int) -> Tuple[Shape, ...]:
        """Block ``index``'s shapes (model/moe.py ``moe_layer`` says which kind it is)."""
        return self.moe_block if moe_layer(model, index) else self.block

    def layer_experts(self, model: ModelConfig, index: int) -> Tuple[bool, ...]:
        """Which of ``layer(model, index)`` are expert weights."""
        return self.moe_experts if moe_layer(model, index) else (False,) * len(self.block)


_MODEL_SHAPES: Dict[Tuple[str, int], ModelShapes] = {}


def _one_block(model: ModelConfig, tp: int, moe: bool) -> Dict[str, List[Tuple[str, Shape]]]:
    cfg = Config(model=copy.deepcopy(model))
    cfg.model.n_layers, cfg.parallel.tp = 1, tp
    if moe:
        cfg.model.moe.first_dense_layers = 0
    else:
        cfg.model.moe.num_experts = 0
    (one_block,) = build_meta_chunks(cfg, planning_dims(cfg, 0))
    parts: Dict[str, List[Tuple[str, Shape]]] = {"before": [], "block": [], "after": []}
    for name, p in one_block.named_parameters():
        part = "block" if name.startswith("layers.") else "after" if parts["block"] else "before"
        parts[part].append((name, tuple(p.shape)))
    return parts


def model_shapes(model: ModelConfig, tp: int) -> ModelShapes:
    """The real model and tensor-parallel layers built on the meta device (no memory), with one
    block of each kind: every dense block has the same shapes, every MoE block too (a 70b meta
    build of all 80 takes seconds, and the planner asks about thousands of layouts). Cached
    per model and tp."""
    key = (repr(sorted(vars(model).items())), tp)
    if key not in _MODEL_SHAPES:
        parts = _one_block(model, tp, moe=False)
        moe = _one_block(model, tp, moe=True)["block"] if model.moe.num_experts else []
        _MODEL_SHAPES[key] = ModelShapes(**{k: tuple(s for _, s in v) for k, v in parts.items()},
                                         moe_block=tuple(s for _, s in moe),
                                         moe_experts=tuple(".experts." in n for n, _ in moe))
    return _MODEL_SHAPES[key]


def stage_parameter_shapes(cfg: Config, stage: int) -> List[Shape]:
    """The shapes pipeline ``stage`` holds on one tp rank, as ``split_into_stages`` cuts the
    model: its blocks, plus what is registered before them (the embedding) on the first stage
    and after them (final norm, head) on the last (parallel/pipeline/stages.py, ``keep_stage``); with
    tied embeddings the last stage also holds the embedding, as its head's weight."""
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), cfg.parallel.pp_layers)
    shapes = model_shapes(cfg.model, cfg.parallel.tp)
    last = len(ranges) - 1
    # a tied head is the embedding matrix: the last stage keeps its own copy of it (off a V's rank 0)
    before = holds_embedding(stage, len(ranges), cfg.model.tie_embeddings, cfg.parallel.pp, cfg.parallel.pp_schedule)
    return [*(shapes.before if before else ()), *(s for i in ranges[stage] for s in shapes.layer(cfg.model, i)),
            *(shapes.after if stage == last else ())]


def stage_muon_mask(cfg: Config, stage: int) -> Optional[List[bool]]:
    """For ``optim.name=muon``, which of ``stage_parameter_shapes(cfg, stage)`` Muon trains (the
    blocks' matrices, trainer3d/optim/muon.py ``is_muon_param``); None for AdamW."""
    if cfg.optim.name != "muon":
        return None
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), cfg.parallel.pp_layers)
    shapes = model_shapes(cfg.model, cfg.parallel.tp)
    last = len(ranges) - 1
    before = holds_embedding(stage, len(ranges), cfg.model.tie_embeddings, cfg.parallel.pp, cfg.parallel.pp_schedule)
    return [*([False] * len(shapes.before) if before else ()),
            *(len(s) >= 2 for i in ranges[stage] for s in shapes.layer(cfg.model, i)),
            *([False] * len(shapes.after) if stage == last else ())]


def rank_parameter_shapes(cfg: Config, rank: int) -> List[Tuple[int, ...]]:
    """Shapes of the parameters global ``rank`` holds, in registration order (its stages, TP-sharded)."""
    p = cfg.parallel
    pp_rank = Topology.of(p).coords(rank).pp
    return [s for stage in stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule) for s in stage_parameter_shapes(cfg, stage)]


def rank_muon_mask(cfg: Config, rank: int) -> Optional[List[bool]]:
    """``stage_muon_mask`` of every stage global ``rank`` holds, aligned with ``rank_parameter_shapes``."""
    p = cfg.parallel
    if cfg.optim.name != "muon":
        return None
    pp_rank = Topology.of(p).coords(rank).pp
    return [m for stage in stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule) for m in stage_muon_mask(cfg, stage)]


# ------------------------------------------------------------------ the paper's Table 1

TABLE1_MODELS = (("7.5B", 7.5e9), ("128B", 128e9), ("1T", 1e12))
TABLE1_DP = (1, 4, 16, 64, 256, 1024)


def table1() -> List[Tuple[str, int, float, float, float]]:
    """Rows (model, dp, P_os GB, P_os+g GB, P_os+g+p GB) of the paper's Table 1 (K=12, decimal GB)."""
    return [(name, dp, *(paper_model_state_bytes(psi, dp, stage) / 1e9 for stage in (1, 2, 3)))
            for name, psi in TABLE1_MODELS for dp in TABLE1_DP]


def format_bytes(n: float) -> str:
    """Binary units for reports: 3.25 GiB, 812.5 MiB."""
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def format_gb(value: float) -> str:
    """Three significant figures, as the paper prints (1.88, 31.4, 536, 4187)."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"
