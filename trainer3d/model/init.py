"""Filling a rank's parameters: the seam between where values come from and where they go.

``fill_parameters(model, source)`` walks the parameters of any stage / TP shard of the
model and asks ``source`` for exactly this rank's slice of each: a source is called with
the parameter's name in the 1-rank model (``layers.3.attention.wq.weight``), its full
logical shape and its ``TPShard`` (None for a whole tensor) and returns the local tensor,
padding rows zero. Given ``rows`` as well, it returns only those dim-0 rows of the local
tensor: the data-parallel shard ZeRO-2/3 keeps (parallel/zero/fsdp.py, ``fill_shards``),
so no rank draws or reads the rest. Two sources exist:

- ``RandomInit``: the layout-independent initialisation. A parameter's values depend only
  on the seed, its name and its full shape, so a TP shard or a pipeline stage starts
  exactly equal to the matching slice of the 1-rank model — the precondition of the parity
  tests. The values are ``torch.randn(full shape)`` from a generator seeded by (seed,
  name); a rank streams through that draw up to the end of its slice and keeps the slice
  (trainer3d/model/normal_stream.py), never holding the full tensor. It draws on the host
  and the caller copies to the device (the same values on every device).
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

from trainer3d.config.schema import ModelConfig
from trainer3d.model.normal_stream import normal_rectangle
from trainer3d.model.transformer import output_projection_std

# Wrappers that insert a level into parameter names without changing the model.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class TPShard:
    """This parameter holds slice ``rank`` of ``size`` equal slices along ``dim`` of a
    tensor whose logical length along ``dim`` is ``full`` (before padding to size * local).
    ``expert``: the slice is an ep rank's experts (dim 0 of an MoE block's expert weights,
    parallel/expert/dispatch.py), replicated over tp rather than split over it."""

    dim: int
    rank: int
    size: int
    full: int
    expert: bool = False

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


def split_over_tp(param: torch.Tensor) -> bool:
    """Whether tp ranks hold different parts of ``param`` (an expert slice is the same on every tp rank)."""
    shard = tp_shard_of(param)
    return shard is not None and not shard.expert


def is_expert_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` is one ep rank's slice of an MoE block's experts."""
    shard = tp_shard_of(param)
    return shard is not None and shard.expert


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


Rows = Optional[Tuple[int, int]]
"""[start, stop) along dim 0 of a rank's local tensor (padding rows included); None: all of it."""


def pad_slice(values: torch.Tensor, shard: Optional[TPShard], padding: Optional[int] = None) -> torch.Tensor:
    """``values`` (this rank's [start, stop) rows) followed by ``padding`` zero rows along the
    shard's dim (default: the shard's own padding)."""
    if shard is None:
        return values
    padding = shard.bounds()[2] if padding is None else padding
    if padding == 0:
        return values
    pad_shape = list(values.shape)
    pad_shape[shard.dim] = padding
    return torch.cat([values, values.new_zeros(pad_shape)], dim=shard.dim)


def slice_bounds(shape: Sequence[int], shard: Optional[TPShard], rows: Rows = None) -> Tuple[list, int]:
    """([start, stop) of the full tensor per dim, zero padding rows along the shard's dim) of
    the block a rank holds: its tp slice, narrowed to ``rows`` of that slice."""
    bounds = [(0, size) for size in shape]
    padding = 0
    if shard is not None:
        start, stop, padding = shard.bounds()
        bounds[shard.dim] = (start, stop)
    if rows is not None:
        lo, hi = rows
        start, stop = bounds[0]
        real = stop - start
        bounds[0] = (start + min(lo, real), start + min(hi, real))
        if shard is not None and shard.dim == 0:  # the rows of [lo, hi) past the real ones are padding
            padding = max(0, hi - max(lo, real))
    return bounds, padding


class ParameterSource(Protocol):
    def __call__(self, name: str, shape: Tuple[int, ...], shard: Optional[TPShard],
                 rows: Rows = None) -> torch.Tensor:
        """This rank's slice of the 1-rank tensor ``name`` of full ``shape`` (host memory;
        padding rows zero), only ``rows`` of it when given; any dtype, ``fill_parameters`` casts."""


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_region(seed: int, name: str, shape: Sequence[int], bounds: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """The rectangle ``bounds`` ([start, stop) per dim) of the standard normal tensor of
    parameter ``name`` and full ``shape`` (1-D, 2-D, or 3-D whole along its last two dims, as
    an MoE block's experts: drawn as the 2-D (E * rows, cols), so a range of experts is a
    range of rows): ``torch.randn(shape)`` from a generator seeded by (seed, name), drawn only
    as far as the rectangle reaches."""
    if len(shape) == 1:
        return normal_region(seed, name, (1, shape[0]), ((0, 1), bounds[0])).view(-1)
    if len(shape) == 3 and tuple(bounds[1:]) == ((0, shape[1]), (0, shape[2])):
        (first, last), rows = bounds[0], shape[1]
        flat = normal_region(seed, name, (shape[0] * rows, shape[2]), ((first * rows, last * rows), bounds[2]))
        return flat.view(last - first, rows, shape[2])
    if len(shape) != 2:
        raise ValueError(f"{name}: random init is defined for 1-D and 2-D parameters, not shape {tuple(shape)}")
    return normal_rectangle(torch.Generator().manual_seed(_seed_for(seed, name)), shape, bounds)


class RandomInit:
    """The layout-independent random initialisation, as a ``ParameterSource``: norm weights
    one, output projections of the residual branches (experts' w2 among them)
    ``output_projection_std``, the rest ``init_std`` (routers too, as Megatron-LM's
    ``init_method`` draws them); only this rank's slice is drawn."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    def __call__(self, name: str, shape: Tuple[int, ...], shard: Optional[TPShard],
                 rows: Rows = None) -> torch.Tensor:
        bounds, padding = slice_bounds(shape, shard, rows)
        if name.endswith("norm.weight"):
            values = torch.ones([stop - start for start, stop in bounds])
        else:
            projection = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
            std = output_projection_std(self.cfg) if projection else self.cfg.init_std
            values = normal_region(self.seed, name, shape, bounds).mul_(std)
        return pad_slice(values, shard, padding)


def full_init(name: str, shape, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The 1-rank model's initial value of parameter ``name`` (fp32, on the host)."""
    return RandomInit(cfg, seed)(name, tuple(shape), None)


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
