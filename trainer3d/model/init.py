"""Filling a rank's parameters: the seam between where values come from and where they go.

``fill_parameters(model, source)`` walks the parameters of any stage / TP shard of the
model and asks ``source`` for exactly this rank's slice of each: a source is called with
the parameter's name in the 1-rank model (``layers.3.attention.wq.weight``), its full
logical shape and its ``TPShard`` (None for a whole tensor) and returns the local tensor,
padding rows zero. Two sources exist:

- ``RandomInit``: the layout-independent initialisation. A parameter's values depend only
  on the seed, its name and its full shape, so a TP shard or a pipeline stage starts
  exactly equal to the matching slice of the 1-rank model — the precondition of the parity
  tests. (It generates the full tensor and keeps its slice: one parameter's worth of host
  memory at a time, not the model's.)
- ``trainer3d.hf.source.HFSource``: a Hugging Face safetensors directory, each rank reading
  only its slices (``model.init_from``).

Tensor-parallel layers describe their slice with ``TPShard`` (set by ``mark_tp_shard``);
parameters without one are whole (replicated across tp).
"""

import hashlib
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Tuple

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

    def bounds(self) -> Tuple[int, int, int]:
        """(start, stop, padding): this rank holds [start, stop) of the full tensor along
        ``dim``, followed by ``padding`` zero rows (the padded vocabulary's tail)."""
        local = -(-self.full // self.size)
        start = min(self.rank * local, self.full)
        stop = min(start + local, self.full)
        return start, stop, local - (stop - start)


def mark_tp_shard(param: nn.Parameter, dim: int, rank: int, size: int, full: int) -> nn.Parameter:
    param.tp_shard = TPShard(dim=dim, rank=rank, size=size, full=full)
    return param


def tp_shard_of(param: torch.Tensor) -> Optional[TPShard]:
    return getattr(param, "tp_shard", None)


def full_shape(local_shape: Sequence[int], shard: Optional[TPShard]) -> Tuple[int, ...]:
    """The logical 1-rank shape of a tensor whose local block has ``local_shape``."""
    shape = list(local_shape)
    if shard is not None:
        shape[shard.dim] = shard.full
    return tuple(shape)


def canonical_name(name: str) -> str:
    """The parameter's name in the plain 1-rank model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def pad_slice(values: torch.Tensor, shard: Optional[TPShard]) -> torch.Tensor:
    """``values`` (this rank's [start, stop) rows) followed by the shard's zero padding rows."""
    if shard is None:
        return values
    padding = shard.bounds()[2]
    if padding == 0:
        return values
    pad_shape = list(values.shape)
    pad_shape[shard.dim] = padding
    return torch.cat([values, values.new_zeros(pad_shape)], dim=shard.dim)


class ParameterSource(Protocol):
    def __call__(self, name: str, shape: Tuple[int, ...], shard: Optional[TPShard]) -> torch.Tensor:
        """This rank's slice of the 1-rank tensor ``name`` of full ``shape`` (host memory;
        padding rows zero); any dtype, ``fill_parameters`` casts."""


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


class RandomInit:
    """The layout-independent random initialisation, as a ``ParameterSource``."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    def __call__(self, name: str, shape: Tuple[int, ...], shard: Optional[TPShard]) -> torch.Tensor:
        values = full_init(name, shape, self.cfg, self.seed)
        if shard is None:
            return values
        start, stop, _ = shard.bounds()
        return pad_slice(values.narrow(shard.dim, start, stop - start), shard)


def local_init(name: str, param: torch.Tensor, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """This rank's slice of ``full_init`` for ``param`` (padding rows are zero)."""
    shard = tp_shard_of(param)
    return RandomInit(cfg, seed)(name, full_shape(param.shape, shard), shard)


@torch.no_grad()
def fill_parameters(model: nn.Module, source: ParameterSource) -> None:
    """Fill every parameter of ``model`` (any stage / TP shard of it) in place from ``source``."""
    for name, param in model.named_parameters():
        shard = tp_shard_of(param)
        values = source(canonical_name(name), full_shape(param.shape, shard), shard)
        if tuple(values.shape) != tuple(param.shape):
            raise ValueError(f"{canonical_name(name)}: the source gave shape {tuple(values.shape)}, "
                             f"this rank holds {tuple(param.shape)}")
        param.copy_(values.to(device=param.device, dtype=param.dtype))


def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of ``model`` with the layout-independent random initialisation."""
    fill_parameters(model, RandomInit(cfg, seed))
