"""Which layers each pipeline stage holds, and cutting the meta-device model into stages.

A pipeline of ``pp`` ranks with ``v`` virtual stages per rank (interleaved 1F1B, zb1p) has
``pp * v`` stages; stage ``s`` runs on pp rank ``s % pp``, so rank ``r`` holds stages
``r, r + pp, r + 2 pp, ...`` (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters", sec. 2.2; torch's interleaved schedules expect exactly
this order). With pp=2, v=2 and 8 layers::

    stage:    0        1        2        3
    rank:     0        1        0        1
    layers:   0-1      2-3      4-5      6-7
    also:     embedding                  final norm, head, loss

The V schedules (``zbv``, ``dualpipev``: Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
sec. 6; DeepSeek-V3 report sec. 3.2.1) place two stages per rank in a V: stage ``s < pp`` on
rank ``s`` and stage ``2 pp - 1 - s`` on rank ``s`` too (torch's ``generate_stage_to_rank_mapping``
with ``style="v"``, torch/distributed/pipelining/schedules.py). With pp=2, 8 layers::

    stage:    0        1        2        3
    rank:     0        1        1        0
    layers:   0-1      2-3      4-5      6-7
    also:     embedding                  final norm, head, loss

so the first and the last stage share rank 0: the loss is computed there, next to the
embedding.

The layer ranges are a pure function (``stage_layer_ranges``) that the dry-run plan and
the tests use without processes; ``split_into_stages`` applies it to the full model built
on the meta device, so a rank never allocates a layer it does not own.
"""

import copy
from typing import List, Optional, Sequence

from torch import nn

from trainer3d.config.schema import Config
from trainer3d.parallel.pipeline.bubble import bubble_theory
from trainer3d.parallel.pipeline.placement import rank_of_stage, stages_of_rank  # noqa: F401  (re-exported)
from trainer3d.parallel.topology import ParallelDims


def stage_layer_ranges(n_layers: int, n_stages: int, pp_layers: Optional[Sequence[int]] = None) -> List[range]:
    """The global layer indices of each stage, in stage order.

    Balanced by default: ``n_layers // n_stages`` each, the remainder one extra layer
    apiece to the *first* stages — the last stage already carries the final norm, the
    output head and the loss, the first only an embedding lookup. ``pp_layers`` gives
    the count per stage explicitly (uneven splits, e.g. a lighter last stage).
    """
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"n_layers={n_layers} cannot fill {n_stages} stages of at least one layer")
    if pp_layers is None:
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    else:
        counts = list(pp_layers)
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(f"parallel.pp_layers={counts} must have {n_stages} entries >= 1 "
                             f"summing to n_layers={n_layers}")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def n_stages(cfg: Config) -> int:
    return cfg.parallel.pp * cfg.parallel.pp_virtual_stages


def keep_stage(model: nn.Module, stage: int, ranges: List[range]) -> nn.Module:
    """Cut ``model`` (a Transformer, on meta) down to ``stage`` in place and return it.

    Layers stay in the ModuleDict under their global index, so parameter names are the
    1-rank model's (``layers.7.attention.wq.weight``) in every layout. With tied embeddings
    the last stage keeps ``tok_embeddings`` as its head's weight, as Megatron-LM's last stage
    keeps a copy of the word embeddings (``setup_embeddings_and_output_layer`` in
    megatron/core/models/common/language_module/language_module.py); trainer3d/parallel/
    tied.py keeps the two copies equal.
    """
    owned = {str(i) for i in ranges[stage]}
    last = len(ranges) - 1
    for key in [k for k in model.layers.keys() if k not in owned]:
        del model.layers[key]
    if stage != 0:
        model.embeds_tokens = False
        if not (model.cfg.tie_embeddings and stage == last):
            model.tok_embeddings = None
    if stage != last:
        model.norm = None
        model.output = None
    return model


def split_into_stages(model: nn.Module, cfg: Config, dims: ParallelDims) -> List[nn.Module]:
    """This rank's chunks of the full meta-device ``model``: one per stage it runs.

    Each chunk is an independent module (a deep copy of the meta model per virtual
    stage; meta tensors cost no memory), still on meta: ``build_model_chunks``
    materialises and initialises them afterwards.
    """
    p = cfg.parallel
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), p.pp_layers)
    stages = stages_of_rank(dims.pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule)
    chunks = []
    for i, stage in enumerate(stages):
        chunk = model if i == len(stages) - 1 else copy.deepcopy(model)
        chunks.append(keep_stage(chunk, stage, ranges))
    return chunks


def describe_stages(cfg: Config) -> str:
    """The dry-run plan's pipeline line: schedule, micro-batches, each stage's layers and rank."""
    p, accum = cfg.parallel, cfg.train.grad_accum_steps
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), p.pp_layers)
    layers = ", ".join(f"stage {s} (pp rank {rank_of_stage(s, p.pp, p.pp_schedule)}): layers {r.start}-{r.stop - 1}" for s, r in enumerate(ranges))
    return (f"pipeline: {p.pp_schedule}, {len(ranges)} stages, {accum} micro-batches, "
            f"bubble_theory {bubble_theory(p.pp, accum, p.pp_virtual_stages, p.pp_schedule):.3f}\n  {layers}")
