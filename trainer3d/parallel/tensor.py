"""Tensor parallelism (Megatron-style, on plain tensors). Not implemented yet."""

from torch import nn

from trainer3d.config import Config
from trainer3d.topology import ParallelDims


def apply_tensor_parallel(model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
    raise NotImplementedError("parallel.tp > 1")


def vocab_parallel_loss_fn(cfg: Config, dims: ParallelDims):
    raise NotImplementedError("parallel.tp > 1")


def sync_sequence_parallel_grads(chunks, optimizer, dims: ParallelDims) -> None:
    raise NotImplementedError("parallel.sequence_parallel")
