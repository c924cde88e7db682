"""Any rectangle of ``torch.randn(shape, generator=g)`` without drawing the whole tensor.

torch's CPU normal kernel (``normal_fill`` in aten/src/ATen/native/cpu/DistributionTemplates.h,
used for contiguous tensors of at least 16 elements) first draws one uniform per element
from the generator, in order, then turns each aligned block of 16 uniforms into 16
normals (Box-Muller); when the size is not a multiple of 16, the last 16 values are
redrawn from 16 further uniforms. Hence, for a generator in the same state:

- a ``randn`` of 16k values started at a multiple of 16 reproduces that block of the full
  draw, bit for bit (the same kernel does the same arithmetic on the same uniforms);
- skipping n values is drawing n uniforms (``torch.rand`` consumes one per element too).

So a rank streams the full tensor's values front to back and keeps its slice, holding at
most ``CHUNK`` values beyond it. The generator (MT19937) cannot jump ahead, so the values
before the slice are still drawn (as uniforms); a slice that starts at the front (tp rank 0
of a row-split matrix) draws nothing else.
"""

from typing import Sequence, Tuple

import torch

CHUNK = 1 << 20
"""Values drawn per call while streaming: 4 MiB of fp32 at a time."""

_BLOCK = 16  # the kernel's Box-Muller block


def _ceil(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


class NormalStream:
    """The values of ``torch.randn(numel, generator=generator)`` (``numel >= 16``), read in
    increasing position order: each ``read`` starts at or after the previous one's stop."""

    def __init__(self, generator: torch.Generator, numel: int):
        if numel < _BLOCK:
            raise ValueError(f"a stream needs at least {_BLOCK} values (torch draws fewer another way), got {numel}")
        self.generator, self.numel = generator, numel
        self.regular = numel - _BLOCK if numel % _BLOCK else numel
        """Positions before this come from their own aligned block; the rest from the redrawn tail."""
        self.drawn = 0
        """Uniforms the generator has given so far."""
        self.buffer = torch.empty(0)
        """Reused by every draw: what ``read`` returns is valid until the next ``read``."""
        self.held, self.held_at = torch.empty(0), 0
        """Values of the last block drawn and the position of the first: a read may start
        inside it (only its positions below ``regular``, or the tail's)."""

    def _skip(self, n: int) -> None:
        buffer = torch.empty(min(n, CHUNK))
        for start in range(0, n, CHUNK):
            torch.rand(min(CHUNK, n - start), generator=self.generator, out=buffer[:min(CHUNK, n - start)])
        self.drawn += n

    def _draw(self, position: int, count: int) -> torch.Tensor:
        """``count`` values as the kernel makes them from the uniforms at ``position`` on."""
        self._skip(position - self.drawn)
        if len(self.buffer) < count:
            self.buffer = torch.empty(count)
        values = torch.randn(count, generator=self.generator, out=self.buffer[:count])
        self.drawn += count
        return values

    def read(self, start: int, stop: int) -> torch.Tensor:
        """The full draw's values at positions [start, stop) (valid until the next read)."""
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"[{start}, {stop}) is outside the {self.numel} values")
        parts = []
        held_stop = self.held_at + len(self.held)
        if self.held_at < self.regular:  # a regular block: its values from ``regular`` on are the tail's
            held_stop = min(held_stop, self.regular)
        if self.held_at <= start < held_stop:
            end = min(stop, held_stop)
            parts.append(self.held[start - self.held_at:end - self.held_at])
            start = end
        end = min(stop, self.regular)
        if start < end:
            first = start // _BLOCK * _BLOCK
            values = self._draw(first, _ceil(end) - first)
            self.held, self.held_at = values[-_BLOCK:].clone(), first + len(values) - _BLOCK
            parts.append(values[start - first:end - first])
            start = end
        if start < stop:  # the redrawn tail: 16 uniforms after all the others
            if self.held_at != self.numel - _BLOCK:
                self._skip(self.numel - self.drawn)
                self.held, self.held_at = torch.randn(_BLOCK, generator=self.generator), self.numel - _BLOCK
                self.drawn += _BLOCK
            parts.append(self.held[start - self.held_at:stop - self.held_at])
        if len(parts) == 1:
            return parts[0]  # no copy: the usual case, a read of whole aligned rows
        return torch.cat(parts) if parts else torch.empty(0)


def normal_rectangle(generator: torch.Generator, shape: Sequence[int],
                     bounds: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """``torch.randn(shape, generator=generator)[r0:r1, c0:c1]`` (fp32, host) for a 2-D
    ``shape`` and ``bounds`` ((r0, r1), (c0, c1)), drawing only up to the rectangle's end."""
    rows, cols = shape
    (r0, r1), (c0, c1) = bounds
    if rows * cols < _BLOCK:
        return torch.randn(rows, cols, generator=generator)[r0:r1, c0:c1]
    out = torch.empty(r1 - r0, c1 - c0)
    stream = NormalStream(generator, rows * cols)
    step = max(1, CHUNK // cols)
    for first in range(r0, r1, step):
        last = min(first + step, r1)
        # whole rows, the rectangle's columns a slice of them: the values beside the columns
        # are no dearer to draw than to skip
        out[first - r0:last - r0] = stream.read(first * cols, last * cols).view(last - first, cols)[:, c0:c1]
    return out
