"""The host copy a background checkpoint stages: ``checkpoint.async_save`` copies a rank's
whole checkpointed state into host buffers that it keeps for the next save
(trainer3d/checkpoint/staging.py), so a run saving in the background holds this much more host
memory from its first save on (pinned on CUDA; on CPU ranks the same memory as the step's).

What is staged is what ``checkpoint_views`` of the rank's optimizer returns
(trainer3d/checkpoint/state.py, ``rank_state``), element by element:

- ZeRO 0/1 (parallel/zero/flat.py): every parameter whole, in the compute dtype; for each
  owned element (no bucket padding) the fp32 moments, and the fp32 master under bf16/fp16;
- ZeRO 2/3 (parallel/zero/fsdp.py): the fp32 parameter shard and its moments, real rows only;
- the step counter, and under fp16 the loss scale and its growth tracker;
- not the last stage's copy of a tied embedding (pp rank > 0): the first stage saves it.

The test that holds this to the saver's own buffers: tests/multirank/test_staged_bytes.py.
"""

from math import prod
from typing import List, Optional, Tuple

from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import zero_shards
from trainer3d.memory.bounded import Bounded
from trainer3d.memory.rank_layout import model_key
from trainer3d.memory.states import BYTES, STEP_BYTES, model_shapes, stage_parameter_shapes
from trainer3d.parallel.pipeline.stages import n_stages, stages_of_rank
from trainer3d.parallel.zero.buckets import plan_buckets

FP16_PERSISTENT_BYTES = 8
"""The fp16 loss scaler's saved tensors: the scale and the growth tracker (optim/mixed_precision.py)."""


def _shapes(cfg: Config, pp_rank: int) -> Tuple[List[Tuple[int, ...]], List[bool]]:
    """The rank's parameter shapes in registration order, and for each whether it is staged."""
    p, last = cfg.parallel, n_stages(cfg) - 1
    tied_copies = len(model_shapes(cfg.model, p.tp).before) if cfg.model.tie_embeddings and pp_rank > 0 else 0
    shapes, kept = [], []
    for stage in stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule):
        part = stage_parameter_shapes(cfg, stage)
        shapes += part
        kept += [not (stage == last and i < tied_copies) for i in range(len(part))]
    return shapes, kept


def _owned_real(numels: List[int], bucket_numel: int, n: int, rank: int) -> List[int]:
    """Per tensor (in the flat buffer's order), its elements in ``rank``'s equal slice of each
    bucket (parallel/zero/flat.py, ``_owned_pieces``); n = 1: all of them."""
    offsets, buckets, _ = plan_buckets(numels, bucket_numel, n)
    owned = [0] * len(numels)
    for start, end, members in buckets:
        size = (end - start) // n
        lo, hi = start + rank * size, start + (rank + 1) * size
        for i in members:
            owned[i] = max(0, min(hi, offsets[i] + numels[i]) - max(lo, offsets[i]))
    return owned


def saves_in_background(cfg: Config) -> bool:
    """The loop saves in the background (every ``checkpoint.every`` steps; the final save and a
    preemption's wait for their whole write, trainer3d/trainer.py)."""
    c = cfg.checkpoint
    return c.async_save and 0 < c.every <= cfg.train.max_steps


_STAGED: Bounded[int] = Bounded(4096)


def staged_bytes(cfg: Config, pp_rank: int, dp_rank: int = 0, model: Optional[str] = None) -> int:
    """Host bytes a background save stages on a rank of ``pp_rank`` at position ``dp_rank``
    of its ZeRO group (dp x cp, HSDP's dp_shard x cp; rank 0 holds the most); 0 where no save runs in the background.
    Cached on what it depends on (the planner asks for every layout it tries); ``model``:
    ``model_key(cfg)`` where the caller has it."""
    if not saves_in_background(cfg):
        return 0
    p = cfg.parallel
    key = (model if model is not None else model_key(cfg)) + repr(
        (p.tp, p.pp, p.pp_virtual_stages, p.pp_layers, p.pp_schedule, p.zero_stage, zero_shards(p), p.bucket_mb,
         cfg.train.dtype, pp_rank, dp_rank))
    return _STAGED.get(key, lambda: _staged(cfg, pp_rank, dp_rank))


def _staged(cfg: Config, pp_rank: int, dp_rank: int) -> int:
    p, dtype = cfg.parallel, cfg.train.dtype
    b, n = BYTES[dtype], zero_shards(p)
    scalars = STEP_BYTES + (FP16_PERSISTENT_BYTES if dtype == "fp16" else 0)
    shapes, kept = _shapes(cfg, pp_rank)
    if p.zero_stage >= 2:  # fp32 shard (the masters) and two moments of the real rows
        real = 0
        for shape, keep in zip(shapes, kept):
            per = -(-shape[0] // n)
            real += keep * min(per, max(0, shape[0] - dp_rank * per)) * prod(shape[1:])
        return 12 * real + scalars
    numels = [prod(s) for s in reversed(shapes)]  # the flat buffer's (backward) order
    bucket = max(1, int(p.bucket_mb * 2 ** 20) // 4)
    owned = _owned_real(numels, bucket, n if p.zero_stage == 1 else 1, dp_rank if p.zero_stage == 1 else 0)
    per_owned = 8 + (4 if b != 4 else 0)
    kept_flat = list(reversed(kept))
    return sum(k * (b * numel + per_owned * o) for k, numel, o in zip(kept_flat, numels, owned)) + scalars
