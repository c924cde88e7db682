"""Load-balanced causal sharding of a sequence over cp ranks, and the positions it keeps.

Under a causal mask a token attends to every earlier one, so cutting the sequence into cp
contiguous pieces would give the last rank cp times the first one's attention work. Cut
into 2·cp chunks instead and give rank i chunks i and 2·cp−1−i (Megatron-Core's
``get_batch_on_this_cp_rank``; the "zigzag" of ring-flash-attention): every rank then holds
one early and one late chunk, and the work is even. With cp = 2 and 8 tokens::

    chunks:   [t0 t1] [t2 t3] [t4 t5] [t6 t7]
    rank 0:   chunks 0, 3 -> positions 0 1 6 7
    rank 1:   chunks 1, 2 -> positions 2 3 4 5

A rank's positions are ascending, so its own tokens attend among themselves under an
ordinary causal mask.
"""

from typing import Tuple

import numpy as np
import torch


def chunks_of(cp: int, cp_rank: int) -> Tuple[int, int]:
    """The two chunks (of 2·cp) cp rank ``cp_rank`` holds."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} outside a cp group of {cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def check_divisible(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(f"train.seq_len={seq_len} is not a multiple of 2 * parallel.cp = {2 * cp}")


def shard_positions(seq_len: int, cp: int, cp_rank: int) -> np.ndarray:
    """The positions in the full sequence of the tokens cp rank ``cp_rank`` holds, ascending."""
    check_divisible(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks_of(cp, cp_rank)])


def local_positions(local_len: int, cp: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """``shard_positions`` from the local length alone (what a layer sees), as a device tensor."""
    chunk = local_len // 2
    first, second = chunks_of(cp, cp_rank)
    idx = torch.arange(chunk, device=device)
    return torch.cat([first * chunk + idx, second * chunk + idx])


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (a copy)."""
    seq_len = x.shape[dim]
    check_divisible(seq_len, cp)
    pieces = x.chunk(2 * cp, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(cp, cp_rank)], dim=dim)
