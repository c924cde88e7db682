"""Apply the layout to the parallelism-agnostic model.

``build_model_chunks`` is the whole recipe, in order:
1. build the full model on the meta device (no memory);
2. pipeline: keep only this rank's stage(s) (parallel/pipeline.py);
3. tensor parallel: swap Linear/Embedding layers for sharded ones (parallel/tensor.py);
4. cast to the training dtype (still on meta, so nothing is ever held in fp32 first),
   materialise on this rank's device and fill from the parameter source: the
   layout-independent random init, or ``model.init_from``'s Hugging Face weights;
5. per-layer activation checkpointing, if asked.
Data parallelism (ZeRO) wraps the result in the optimizer (parallel/zero.py).
"""

from typing import Callable, List

import torch
from torch import nn

from trainer3d.config import Config
from trainer3d.model.init import ParameterSource, RandomInit, fill_parameters
from trainer3d.model.transformer import Transformer, cross_entropy_loss
from trainer3d.topology import ParallelDims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_meta_chunks(cfg: Config, dims: ParallelDims) -> List[nn.Module]:
    """Steps 1-3: this rank's chunks, split and tensor-parallel, still on the meta device
    (the dry run reads their shapes without allocating anything)."""
    from trainer3d.parallel.pipeline import split_into_stages
    from trainer3d.parallel.tensor import apply_tensor_parallel

    with torch.device("meta"):
        model = Transformer(cfg.model)
    chunks = split_into_stages(model, cfg, dims) if dims.pp > 1 else [model]
    if dims.tp > 1:
        for chunk in chunks:
            apply_tensor_parallel(chunk, cfg, dims)
    return chunks


def parameter_source(cfg: Config) -> ParameterSource:
    """Where the initial values come from: ``model.init_from``'s weights, else the random init."""
    if cfg.model.init_from:
        from trainer3d.hf.source import HFSource
        return HFSource(cfg.model.init_from, cfg.model)
    return RandomInit(cfg.model, cfg.train.seed)


def build_model_chunks(cfg: Config, dims: ParallelDims) -> List[nn.Module]:
    """This rank's model chunks (one per pipeline stage it runs; one when pp == 1)."""
    chunks = build_meta_chunks(cfg, dims)
    source = parameter_source(cfg)
    for chunk in chunks:
        chunk.to(dtype=DTYPES[cfg.train.dtype])
        chunk.to_empty(device=dims.device)
        fill_parameters(chunk, source)
    if cfg.train.activation_checkpointing:
        from trainer3d.parallel.recompute import checkpoint_layers
        checkpoint_layers(chunks)
    return chunks


def build_loss_fn(cfg: Config, dims: ParallelDims) -> Callable:
    """(logits, targets) -> mean token loss; vocabulary-parallel when tp > 1."""
    if dims.tp > 1:
        from trainer3d.parallel.tensor import vocab_parallel_loss_fn
        return vocab_parallel_loss_fn(cfg, dims)
    return cross_entropy_loss
