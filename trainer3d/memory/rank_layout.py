"""What a pipeline rank holds by the model and the pipeline's knobs alone: its stages, their
layers and MoE blocks, and its parameter shapes (trainer3d/memory/states.py
``stage_parameter_shapes``, in the order ``split_into_stages`` registers them).

The planner's search (trainer3d/plan/search.py) asks ``rank_memory`` (trainer3d/memory/peak.py)
about the same pipeline rank of thousands of layouts that differ only in what this does not
depend on (micro-batch, ZeRO stage, dp, recomputation, sequence parallelism), so each is
built once per model, tp, pp, virtual stages, ``pp_layers``, schedule and rank.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from trainer3d.config.schema import Config
from trainer3d.memory.bounded import Bounded
from trainer3d.memory.moe import moe_layers, stage_expert_mask
from trainer3d.memory.states import ModelShapes, Shape, model_shapes, stage_muon_mask, stage_parameter_shapes
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank


@dataclass(frozen=True)
class RankLayout:
    stages: Tuple[int, ...]
    """The rank's stages (chunks), in local order."""
    last: int
    """The model's last stage."""
    layers: Tuple[int, ...]
    """Blocks of each of the rank's stages."""
    moe: Tuple[int, ...]
    """MoE blocks of each of the rank's stages."""
    shapes: ModelShapes
    """The model's shapes on one tp rank (``model_shapes``)."""
    params: Tuple[Shape, ...]
    """The rank's parameter shapes, its stages in order."""
    experts: Tuple[bool, ...]
    """Which of ``params`` are expert weights (``stage_expert_mask``)."""
    muon: Optional[Tuple[bool, ...]]
    """Which of ``params`` Muon trains (``stage_muon_mask``); None for AdamW."""


def model_key(cfg: Config) -> str:
    """The model's knobs, as a key of the caches that depend on the model."""
    return repr(sorted(vars(cfg.model).items()))


_LAYOUTS: Bounded[RankLayout] = Bounded(4096)


def rank_layout(cfg: Config, pp_rank: int, model: Optional[str] = None) -> RankLayout:
    """Pipeline rank ``pp_rank``'s ``RankLayout``, cached; ``model``: ``model_key(cfg)`` where
    the caller has it."""
    p = cfg.parallel
    key = (model if model is not None else model_key(cfg),
           repr((p.tp, p.pp, p.pp_virtual_stages, p.pp_layers, p.pp_schedule, pp_rank, cfg.optim.name == "muon")))
    return _LAYOUTS.get(key, lambda: _build(cfg, pp_rank))


def _build(cfg: Config, pp_rank: int) -> RankLayout:
    p = cfg.parallel
    stages = tuple(stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule))
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), p.pp_layers)
    muon = tuple(m for s in stages for m in stage_muon_mask(cfg, s)) if cfg.optim.name == "muon" else None
    return RankLayout(
        stages=stages, last=len(ranges) - 1, layers=tuple(len(ranges[s]) for s in stages),
        moe=tuple(moe_layers(cfg, s) for s in stages), shapes=model_shapes(cfg.model, p.tp),
        params=tuple(x for s in stages for x in stage_parameter_shapes(cfg, s)),
        experts=tuple(x for s in stages for x in stage_expert_mask(cfg, s)), muon=muon)
