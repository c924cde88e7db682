"""The metrics' one collective per logging interval (trainer3d/observe/metrics.py): every rank's
vector gathered on every rank, and what may ride in it (the straggler watch, observe/stragglers.py;
the non-finite check, observe/nonfinite.py)."""

from typing import Dict, List, Optional, Protocol

import torch
import torch.distributed as dist


class Gathered(Protocol):
    """A rider of the metrics' all-gather (``MetricsLogger.add_gathered``, ``flush(also=...)``)."""

    def mine(self) -> torch.Tensor:
        """This rank's values: a 1-D tensor, as long on every rank (it may be empty)."""

    def take(self, rows: torch.Tensor) -> Dict[str, List[Optional[float]]]:
        """Every rank: the gathered values, (world, len(mine())); returns columns of metrics.jsonl
        (rank 0's are written; {} for none)."""


def all_gather_rows(mine: torch.Tensor) -> torch.Tensor:
    """Every rank's ``mine`` (1-D, as long on every rank), stacked: (world, len)."""
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)
