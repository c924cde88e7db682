"""Layout-independent parameter initialisation.

A parameter's values depend only on the seed, its name in the 1-rank model
(``layers.3.attention.wq.weight``) and its full logical shape. Every rank generates the
full tensor of each parameter it holds and keeps its own slice, so a TP shard or a
pipeline stage starts exactly equal to the matching slice of the 1-rank model — the
precondition of the parity tests. (Generating the full tensor costs one parameter's worth
of host memory at a time, not the model's.)

Tensor-parallel layers describe their slice with ``TPShard`` (set by ``mark_tp_shard``);
parameters without one are whole (replicated across tp).
"""

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from trainer3d.config import ModelConfig
from trainer3d.model.transformer import output_projection_std

# Wrappers that insert a level into parameter names without changing the model.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class TPShard:
    """This parameter holds slice ``rank`` of ``size`` equal slices along ``dim`` of a
    tensor whose logical length along ``dim`` is ``full`` (before padding to size * local)."""

    dim: int
    rank: int
    size: int
    full: int


def mark_tp_shard(param: nn.Parameter, dim: int, rank: int, size: int, full: int) -> nn.Parameter:
    param.tp_shard = TPShard(dim=dim, rank=rank, size=size, full=full)
    return param


def tp_shard_of(param: torch.Tensor) -> Optional[TPShard]:
    return getattr(param, "tp_shard", None)


def canonical_name(name: str) -> str:
    """The parameter's name in the plain 1-rank model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init(name: str, shape, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The 1-rank model's initial value of parameter ``name`` (fp32, on the host)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = output_projection_std(cfg) if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
    generator = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=generator) * std


def local_init(name: str, param: torch.Tensor, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """This rank's slice of ``full_init`` for ``param`` (padding rows are zero)."""
    shard = tp_shard_of(param)
    if shard is None:
        return full_init(name, tuple(param.shape), cfg, seed)
    full_shape = list(param.shape)
    full_shape[shard.dim] = shard.full
    values = full_init(name, full_shape, cfg, seed)
    local = param.shape[shard.dim]
    padding = local * shard.size - shard.full
    if padding > 0:
        pad_shape = list(full_shape)
        pad_shape[shard.dim] = padding
        values = torch.cat([values, torch.zeros(pad_shape)], dim=shard.dim)
    return values.narrow(shard.dim, shard.rank * local, local)


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of ``model`` (any stage / TP shard of it) in place."""
    for name, param in model.named_parameters():
        values = local_init(canonical_name(name), param, cfg, seed)
        param.copy_(values.to(device=param.device, dtype=param.dtype))
