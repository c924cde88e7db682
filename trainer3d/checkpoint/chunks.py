"""Where a rank's piece of a tensor sits in the full, layout-free tensor.

Checkpoints store every tensor under its 1-rank name in its full logical shape (vocabulary
unpadded), so any layout can read what any other wrote. A rank holds either a whole tensor
(replicated), a tensor-parallel shard (a block along one dim, possibly with padding rows at
the end), or — for ZeRO-1 optimizer state — a flat range of such a shard. A flat range of
a 2-D block is at most three rectangles (a partial first row, whole rows, a partial last
row), each contiguous in the flat buffer (a 3-D one, such as an MoE block's experts, the
same along its first dimension, its partial slices cut as 2-D ones), so every piece can be named by (offsets, sizes)
in the full tensor and read or written in place.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from trainer3d.model.init import TPShard, full_shape  # noqa: F401  (full_shape re-exported)


@dataclass(frozen=True)
class Piece:
    """``sizes`` elements at ``offsets`` of the full tensor = flat elements
    ``[flat_start, flat_start + numel)`` of the rank's local (shard) tensor."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def _local_rectangles(shape: Sequence[int], start: int, end: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], int]]:
    """Rectangles (local offsets, sizes, flat start) covering flat range [start, end) of ``shape``."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    if len(shape) > 2:
        return _sliced_rectangles(shape, start, end)
    cols = shape[1]
    r0, c0 = divmod(start, cols)
    r1, c1 = divmod(end, cols)
    if r0 == r1:
        return [((r0, c0), (1, c1 - c0), start)]
    out = []
    if c0:
        out.append(((r0, c0), (1, cols - c0), start))
        r0 += 1
    if r1 > r0:
        out.append(((r0, 0), (r1 - r0, cols), r0 * cols))
    if c1:
        out.append(((r1, 0), (1, c1), r1 * cols))
    return out


def _sliced_rectangles(shape: Sequence[int], start: int, end: int):
    """As for 2-D, one dimension up (an MoE block's (experts, rows, cols) weights): a partial
    first slice along dim 0, the whole slices, a partial last slice, the partial ones cut as
    the lower-dimensional slice is."""
    inner = 1
    for size in shape[1:]:
        inner *= size
    (i0, o0), (i1, o1) = divmod(start, inner), divmod(end, inner)

    def within(i: int, lo: int, hi: int):
        return [((i, *off), (1, *sizes), i * inner + flat) for off, sizes, flat in _local_rectangles(shape[1:], lo, hi)]

    if i0 == i1:
        return within(i0, o0, o1)
    out = []
    if o0:
        out += within(i0, o0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *[0] * (len(shape) - 1)), (i1 - i0, *shape[1:]), i0 * inner))
    if o1:
        out += within(i1, 0, o1)
    return out


def pieces(local_shape: Sequence[int], shard: Optional[TPShard], start: int = 0,
           end: Optional[int] = None) -> List[Piece]:
    """The pieces of the full tensor held by flat range [start, end) of the local block.

    ``end`` defaults to the whole block. Padding (rows of a TP shard past ``shard.full``)
    belongs to no piece: it is never saved and never loaded.
    """
    numel = 1
    for s in local_shape:
        numel *= s
    end = numel if end is None else end
    out = []
    for offsets, sizes, flat_start in _local_rectangles(local_shape, start, end):
        offsets, sizes = list(offsets), list(sizes)
        if shard is not None:
            d = shard.dim
            base = shard.rank * local_shape[d]
            lo = base + offsets[d]
            hi = min(lo + sizes[d], shard.full)
            if hi <= lo:
                continue  # all padding
            if hi - lo < sizes[d] and d != 0 and sizes[0] > 1:
                raise ValueError("padding inside a multi-row piece along a non-leading dim is not supported")
            offsets[d], sizes[d] = lo, hi - lo
        out.append(Piece(tuple(offsets), tuple(sizes), flat_start))
    return out
