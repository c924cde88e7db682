"""Which windows make up each step's global batch: shuffling, blending, the validation split.

Windows: a source's tokens are cut into windows of seq_len + 1 tokens starting every
seq_len tokens (inputs are a window's first seq_len tokens, targets its last seq_len).

Global sample ``j`` (step ``s`` holds samples ``s*G .. s*G + G - 1``, G = global batch)
is found in two steps, both pure functions of ``j`` and the seed:

1. **Blend** (``Blend``): which source, and the how-many-th sample of that source it is.
   The sources' weights are split as a balanced binary tree; at each node the first ``T``
   samples reaching it are divided as ``left = floor(T * w_left / (w_left + w_right) + 1/2)``,
   the rest to the right. Counts only grow with ``T`` (one sample moves one count at each
   level), they always sum to ``T``, and each level adds at most 1/2 sample of deviation,
   so after any number of samples ``|count_k - T * w_k| <= ceil(log2 K) / 2`` (K sources;
   plus ``T * K / 2^21`` from rounding the weights to WEIGHT_UNITS). One source (no blend)
   is the identity.
2. **Shuffle** (``SampleOrder``): the n-th sample of a source is window
   ``permute(n mod W, W, key(seed, source, epoch = n // W))`` of its W windows, a seeded
   bijection (trainer3d/data/shuffle.py) — every window once per epoch, a new order each
   epoch, memory independent of W.

So the global batch of a step is the same whatever the layout, and resuming at step ``s``
reads what an uninterrupted run would: the whole position is the number of samples consumed
(``Origin``: step x batch for a run that kept its batch size).

Validation (``split``): ``data.val_fraction`` holds out the last fraction of each source's
tokens (a contiguous tail, so no validation token is ever inside a training window);
``data.val_path`` is a separate file. Validation batches come in a fixed order (keyed
independently of ``train.seed``, so runs with different seeds are evaluated on the same
windows) from the same blend weights; every evaluation reads the same first validation samples
(trainer3d/data/sources.py ``eval_windows``), the last global batch padded (trainer3d/data/loader.py).
"""

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from trainer3d.data.shuffle import derive_key, permute

VALIDATION_KEY = 0x7A11DA7E
"""The shuffle key of validation orders, in place of train.seed."""
WEIGHT_UNITS = 2 ** 20
"""Blend weights are used as integer multiples of 1/WEIGHT_UNITS of their total (exact integer arithmetic)."""


@dataclass(frozen=True)
class Span:
    """The windows over tokens ``[start, start + n_tokens)`` of one token file."""

    start: int
    n_tokens: int
    seq_len: int

    @property
    def n_windows(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)


def split(n_tokens: int, val_fraction: float) -> Tuple[int, int]:
    """(training tokens, validation tokens): the validation part is the last ``val_fraction``."""
    n_val = int(n_tokens * val_fraction)
    return n_tokens - n_val, n_val


class Blend:
    """Global sample -> (source, index within that source) for sources drawn in proportion to weights."""

    def __init__(self, weights: Sequence[float]):
        if not weights or min(weights) <= 0:
            raise ValueError(f"blend weights must be > 0, got {list(weights)}")
        total = float(sum(weights))
        self.parts = [round(w / total * WEIGHT_UNITS) for w in weights]
        if min(self.parts) < 1:
            raise ValueError(f"blend weights {list(weights)}: each must be at least 1/{WEIGHT_UNITS} of the total")
        self.depth = (len(weights) - 1).bit_length()

    def _descend(self, lo: int, hi: int, before: np.ndarray, after: np.ndarray,
                 source: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
        """Route samples whose count at this node goes before -> after (= before + 1)."""
        if hi - lo == 1:
            source[rows], index[rows] = lo, before
            return
        mid = (lo + hi) // 2
        num, den = sum(self.parts[lo:mid]), sum(self.parts[lo:hi])
        left0, left1 = (2 * before * num + den) // (2 * den), (2 * after * num + den) // (2 * den)
        go_left = left1 > left0
        self._descend(lo, mid, left0[go_left], left1[go_left], source, index, rows[go_left])
        right = ~go_left
        self._descend(mid, hi, (before - left0)[right], (after - left1)[right], source, index, rows[right])

    def __call__(self, samples) -> Tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and int(samples.max()) >= 2 ** 61 // (WEIGHT_UNITS + len(self.parts)):
            raise OverflowError("sample index too large for the blend arithmetic")
        source, index = np.zeros_like(samples), np.zeros_like(samples)
        flat = samples.reshape(-1)
        self._descend(0, len(self.parts), flat, flat + 1, source.reshape(-1), index.reshape(-1),
                      np.arange(flat.size))
        return source, index


class SampleOrder:
    """Global sample -> (source, window): the blend, then each source's shuffled epochs."""

    def __init__(self, n_windows: Sequence[int], weights: Sequence[float], seed: int):
        if min(n_windows) < 1:
            raise ValueError(f"every source needs at least one window, got {list(n_windows)}")
        self.n_windows = np.asarray(n_windows, dtype=np.int64)
        self.blend = Blend(weights)
        self.seed = seed

    def __call__(self, samples) -> Tuple[np.ndarray, np.ndarray]:
        source, n = self.blend(samples)
        windows = np.empty_like(n)
        for k in np.unique(source):
            rows = source == k
            epoch, pos = np.divmod(n[rows], self.n_windows[k])
            windows[rows] = permute(pos, int(self.n_windows[k]), derive_key(self.seed, k, epoch))
        return source, windows


@dataclass(frozen=True)
class Origin:
    """Where a run's data position starts: after ``samples`` samples, at step ``step``. A run
    resumed from a checkpoint starts after the samples it consumed (its marker records them:
    trainer3d/checkpoint/lineage.py), so a change of the global batch between the two neither
    repeats nor skips a sample."""

    step: int = 0
    samples: int = 0

    def samples_at(self, step: int, global_batch_size: int) -> int:
        """Samples consumed before ``step`` (``step >= self.step``)."""
        return self.samples + (step - self.step) * global_batch_size


def step_samples(step: int, global_batch_size: int, start: int, count: int, origin: Origin = Origin()) -> np.ndarray:
    """Global sample ids ``start .. start + count - 1`` of step ``step``'s batch."""
    first = origin.samples_at(step, global_batch_size) + start
    return np.arange(first, first + count, dtype=np.int64)

