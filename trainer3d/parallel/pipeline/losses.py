"""The seam between a step's loss computations and the trainer that reads them.

The loss function of a micro-batch (the trainer's ``MicroBatchLoss``) records each plain
loss in a ``StepLosses``; the pipeline schedule (or the plain loop) calls it once per
micro-batch, and the trainer takes the step's mean afterwards. torch's pipeline also calls
the loss function once on a copy of micro-batch 0 when it infers the stages' shapes (the
first step, and the first after an evaluation: torch/distributed/pipelining/stage.py,
``_backward_metadata_inference``): the pipeline runs that call inside ``not_recorded``, so
the record holds exactly the step's micro-batches and nothing is ever taken out of it.
"""

from contextlib import contextmanager
from typing import List, Optional

import torch


class StepLosses:
    """The plain (unscaled, detached) losses of the micro-batches computed since the last ``take_mean``."""

    def __init__(self):
        self._values: List[torch.Tensor] = []
        self._paused = 0

    def record(self, loss: torch.Tensor) -> None:
        """Keep ``loss`` (detached) unless a ``not_recorded`` block is open."""
        if not self._paused:
            self._values.append(loss.detach())

    @contextmanager
    def not_recorded(self):
        """Loss computations inside are not micro-batches of the step (shape inference)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> List[torch.Tensor]:
        """The recorded losses in the order computed (micro-batch order), without taking them."""
        return list(self._values)

    def take_mean(self, expected: Optional[int] = None) -> Optional[torch.Tensor]:
        """The mean of the recorded losses (None where none were computed), and an empty record.

        ``expected``: how many micro-batches the step ran; a different count raises (a
        schedule that computed a loss twice or skipped one would bias the logged loss).
        """
        values, self._values = self._values, []
        if not values:
            return None
        if expected is not None and len(values) != expected:
            raise RuntimeError(f"{len(values)} losses recorded for a step of {expected} micro-batches")
        return torch.stack(values).mean()

    def take_sum(self) -> Optional[torch.Tensor]:
        """The sum of the recorded values (evaluation's token-loss sums; None where none were
        computed), and an empty record."""
        values, self._values = self._values, []
        return torch.stack(values).sum() if values else None
