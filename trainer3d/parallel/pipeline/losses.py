"""The seam between a step's loss computations and the trainer that reads them.

The loss function of a micro-batch (``MicroBatchLoss``, below) records each plain
loss in a ``StepLosses``; the pipeline schedule (or the plain loop) calls it once per
micro-batch, and the trainer takes the step's mean afterwards. torch's pipeline also calls
the loss function once on a copy of micro-batch 0 when it infers the stages' shapes (the
first step, and the first after an evaluation: torch/distributed/pipelining/stage.py,
``_backward_metadata_inference``): the pipeline runs that call inside ``not_recorded``, so
the record holds exactly the step's micro-batches and nothing is ever taken out of it.
"""

from contextlib import contextmanager
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from trainer3d.data.loss_mask import IGNORE_INDEX
from trainer3d.parallel.topology import ParallelDims
from trainer3d.parallel.zero.optimizer import ZeroOptimizer


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


class MicroBatchLoss:
    """The loss function of one micro-batch, as the pipeline schedule and the plain loop call it.

    It records the plain loss (for logging) in ``losses``, the step's ``StepLosses``, and
    returns what backward needs: the loss divided by grad_accum (so accumulated gradients
    are those of the step's mean loss; the schedule's own gradient scaling stays off) and
    multiplied by the optimizer's loss scale (fp16). Inside ``summing`` (evaluation) it
    records ``sum_fn``'s sum of the token losses whose target counts instead
    (trainer3d/parallel/tensor/loss_sum.py).

    With a loss mask (``data.loss_mask``; masked-out targets are ``IGNORE_INDEX``) the step's loss
    is the sum of the kept tokens' losses over the whole global batch divided by their count N,
    whatever the layout. ``normalise`` counts them once per global batch (one all-reduce of one
    number over dp x cp, before any backward) and each micro-batch's loss becomes its kept sum
    divided by N / (grad_accum x dp x cp): the mean of those over the micro-batches and the dp x cp
    ranks, which the trainer's 1/grad_accum and the gradients' average over dp x cp take, is the
    sum over all kept tokens divided by N, and so is the logged loss (observe/metrics.py).
    """

    def __init__(self, loss_fn: Callable, grad_accum_steps: int, optimizer: ZeroOptimizer,
                 sum_fn: Optional[Callable] = None, dims: Optional[ParallelDims] = None, loss_mask: bool = False):
        self.loss_fn, self.sum_fn = loss_fn, sum_fn
        self.grad_accum_steps = grad_accum_steps
        self.optimizer = optimizer
        self.losses = StepLosses()
        self._summing = False
        self.dims, self.loss_mask = dims, loss_mask
        self.norm: Optional[torch.Tensor] = None
        """N / (grad_accum x dp x cp) of the global batch being run (a device tensor), None without a mask."""

    def normalise(self, targets: Optional[torch.Tensor]) -> None:
        """Set the normaliser from this rank's share of a global batch's ``targets`` (grad_accum,
        micro_batch, seq); a no-op without a loss mask or where no loss is computed (targets None).
        A batch with no kept token gets N = 1: its loss and gradient are zero."""
        if not self.loss_mask or targets is None:
            return
        count = (targets != IGNORE_INDEX).sum()  # int64: exact at any batch size
        if self.dims.dp_cp > 1:
            dist.all_reduce(count, group=self.dims.dp_cp_group)
        self.norm = count.clamp_min(1) / (targets.shape[0] * self.dims.dp_cp)  # fp32, rounded once

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self._summing:
            total = self.sum_fn(output, targets)
            self.losses.record(total)
            return total
        loss = self.loss_fn(output, targets) if self.norm is None else self.loss_fn(output, targets, self.norm)
        self.losses.record(loss)
        return self.optimizer.scale_loss(loss) / self.grad_accum_steps

    @contextmanager
    def summing(self):
        """Calls inside record the token-loss sum of their micro-batch (evaluation)."""
        if self.sum_fn is None:
            raise RuntimeError("this MicroBatchLoss was built without a sum_fn: it cannot evaluate")
        self._summing = True
        try:
            yield
        finally:
            self._summing = False

    def pop_mean(self) -> Optional[torch.Tensor]:
        """Mean loss of the micro-batches since the last call (None where no loss is computed)."""
        return self.losses.take_mean()
