"""Stop a run whose loss or gradients stop being finite, instead of training on NaN.

Each step keeps its loss (on the ranks that compute it) and its global gradient norm (the
same on every rank: it comes from one all-reduce), device scalars the metrics keep too; no
operator runs then. At a check the steps kept since the last one are tested in one pass
(stacked, ``isfinite``), the first non-finite step is reduced over the ranks and read where
the loop syncs anyway — at the logging interval, riding in the metrics' all-gather
(trainer3d/observe/metrics.py ``flush(also=...)``), and before a checkpoint is written (an
all-reduce of its own, skipped where no step was kept since the last check: every rank keeps
the same steps), so a checkpoint never holds weights after a non-finite step. fp16 steps whose gradients
overflow are the loss scaler's business (skipped, the scale halved): there only a
non-finite loss counts.

``train.on_nonfinite``: stop (default: every rank raises NonFiniteLoss, the job ends with
the message below and a non-zero exit, no checkpoint is saved) | continue (rank 0 prints one
warning line per check that finds a new non-finite step, and the run goes on).
"""

from typing import Dict, List

import torch
import torch.distributed as dist


class NonFiniteLoss(RuntimeError):
    """Raised on every rank, at the same step, when train.on_nonfinite=stop."""


NEVER = torch.iinfo(torch.int64).max


class NonFiniteWatch:
    def __init__(self, device: torch.device, norm_counts: bool, action: str):
        self.device = device
        self.norm_counts = norm_counts
        """False for fp16: a non-finite gradient norm is a loss-scale overflow, skipped on the device."""
        self.action = action
        self._steps: List[int] = []
        self._values: List[List[torch.Tensor]] = []

    def record(self, step: int, loss, grad_norm: torch.Tensor) -> None:
        """No sync, no device work: keep this step's loss (on the ranks that compute it) and, outside
        fp16, its gradient norm; ``check`` tests the steps kept since the last one in one pass."""
        values = [loss.detach()] if loss is not None else []
        if self.norm_counts:
            values.append(grad_norm.detach())
        self._steps.append(step)
        self._values.append(values)

    def first_bad(self) -> torch.Tensor:
        """On the device: the first step kept since the last check whose loss or norm is not finite
        (NEVER if none), the kept steps then forgotten."""
        steps, values = self._steps, self._values
        self._steps, self._values = [], []
        kept = [(s, v) for s, v in zip(steps, values) if v]
        if not kept:
            return torch.full((), NEVER, dtype=torch.int64, device=self.device)
        scalars = [t if t.dim() == 0 else t.float().sum() for _, v in kept for t in v]  # a sum keeps inf/nan
        bad = ~torch.isfinite(torch.stack(scalars))
        at = torch.tensor([s for s, v in kept for _ in v], dtype=torch.int64, device=self.device)
        return torch.where(bad, at, torch.full_like(at, NEVER)).min()

    def check(self) -> None:
        """Every rank at the same steps: raise NonFiniteLoss if any rank saw a non-finite step
        (with ``continue``: warn on rank 0 and watch for the next one). No collective where no
        step was kept since the last check (the same on every rank)."""
        if not self._steps:
            return
        first = self.first_bad()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        self._settle(int(first.item()))

    def mine(self) -> torch.Tensor:
        """``check`` as a rider of the metrics' all-gather: this rank's first non-finite step
        since the last check (inf: none), as float64."""
        first = self.first_bad()
        return torch.where(first == NEVER, torch.full((1,), float("inf"), dtype=torch.float64, device=first.device),
                           first.double().reshape(1))

    def take(self, rows: torch.Tensor) -> Dict[str, list]:
        """Every rank, with every rank's ``mine()``: ``check``'s verdict (no columns)."""
        first = rows.min().item()
        self._settle(NEVER if first == float("inf") else int(first))
        return {}

    def _settle(self, step: int) -> None:
        if step == NEVER:
            return
        if self.action == "continue":
            if dist.get_rank() == 0:
                print(f"trainer3d: warning: the loss or gradient norm is not finite (inf/nan) from step {step + 1}; "
                      "training goes on (train.on_nonfinite=continue)", flush=True)
            return
        raise NonFiniteLoss(
            f"the loss or gradient norm is not finite (inf/nan) at step {step + 1}; the run stopped without "
            "saving (train.on_nonfinite=stop): resume from the last checkpoint with a lower optim.lr, "
            "or set train.on_nonfinite=continue to train on")
