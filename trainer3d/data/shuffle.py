"""A seeded bijection of ``range(n)`` computed one element at a time: shuffling without a table.

``permute(positions, n, keys)`` returns where each position goes under the permutation
that ``keys`` selects. It is a Feistel network over the smallest even number of bits that
covers ``n``, with cycle walking to stay inside ``range(n)`` (Black and Rogaway, "Ciphers
with Arbitrary Finite Domains", CT-RSA 2002, sec. 2): a Feistel network is a bijection of
its bit domain whatever the round function, and re-applying it to values that land at or
above ``n`` follows each element's cycle back into the range, so the restriction is a
bijection of ``range(n)`` too. Four rounds (Luby and Rackoff 1988) with a 64-bit mixing
function (the finaliser of SplitMix64, Steele et al., OOPSLA 2014) make the order look
random for data-loading purposes; it is not a cipher.

Memory is that of the ``positions`` array: the sampler never materialises a permutation of
every window (which at 1T tokens and seq 4096 would be ~2 GB per rank per epoch).
Expected cycle-walking rounds are below 4 (the bit domain is less than 4n).
"""

from typing import Union

import numpy as np

ROUNDS = 4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective, well-mixing map of uint64 values (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: Union[int, np.ndarray]) -> np.ndarray:
    """One uint64 key (or an array of them) from integers, e.g. (seed, source, epoch)."""
    key = np.zeros((), dtype=np.uint64)
    for part in parts:
        key = mix64(key ^ np.asarray(part, dtype=np.int64).astype(np.uint64))
    return key


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for r in range(ROUNDS):
        with np.errstate(over="ignore"):
            f = mix64(right ^ (keys + np.uint64(r) * _GOLDEN)) & mask
        left, right = right, left ^ f
    return (left << shift) | right


def permute(positions, n: int, keys) -> np.ndarray:
    """The images of ``positions`` (ints in [0, n)) under the bijection of range(n) chosen by ``keys``.

    ``keys`` is one uint64 key or one per position (e.g. a new key per epoch).
    """
    positions = np.asarray(positions, dtype=np.int64)
    if n < 1 or positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    if n == 1:
        return np.zeros_like(positions)
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    keys = np.broadcast_to(np.asarray(keys, dtype=np.uint64), positions.shape)
    x = positions.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle walking: every element ends inside range(n)
        x[todo] = _feistel(x[todo], bits // 2, keys[todo])
        todo = x >= np.uint64(n)
    return x.astype(np.int64)
