"""Pipeline parallelism (1F1B). Not implemented yet."""

from torch import nn

from trainer3d.config import Config
from trainer3d.topology import ParallelDims


def split_into_stages(model: nn.Module, cfg: Config, dims: ParallelDims):
    raise NotImplementedError("parallel.pp > 1")


def build_pipeline(chunks, loss_fn, cfg: Config, dims: ParallelDims):
    raise NotImplementedError("parallel.pp > 1")
