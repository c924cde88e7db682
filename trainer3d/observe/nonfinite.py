"""Stop a run whose loss or gradients stop being finite, instead of training on NaN.

Each step adds, on the device, whether its loss (on the ranks that compute it) or its
global gradient norm (the same on every rank: it comes from one all-reduce) is inf/NaN,
and the first such step. Nothing is read then: the flag is all-reduced and read where the
loop syncs anyway — at the logging interval, and before a checkpoint is written, so a
checkpoint never holds weights after a non-finite step. fp16 steps whose gradients
overflow are the loss scaler's business (skipped, the scale halved): there only a
non-finite loss counts.

``train.on_nonfinite``: stop (default: every rank raises NonFiniteLoss, the job ends with
the message below and a non-zero exit, no checkpoint is saved) | continue (rank 0 prints one
warning line per check that finds a new non-finite step, and the run goes on).
"""

import torch
import torch.distributed as dist


class NonFiniteLoss(RuntimeError):
    """Raised on every rank, at the same step, when train.on_nonfinite=stop."""


class NonFiniteWatch:
    def __init__(self, device: torch.device, norm_counts: bool, action: str):
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self.norm_counts = norm_counts
        """False for fp16: a non-finite gradient norm is a loss-scale overflow, skipped on the device."""
        self.action = action

    def record(self, step: int, loss, grad_norm: torch.Tensor) -> None:
        """No sync: the first step whose loss (or, outside fp16, gradient norm) is not finite."""
        bad = torch.zeros((), dtype=torch.bool, device=self.first_bad.device)
        if loss is not None:
            bad = bad | ~torch.isfinite(loss.detach()).all()
        if self.norm_counts:
            bad = bad | ~torch.isfinite(grad_norm).all()
        fresh = bad & (self.first_bad < 0)
        self.first_bad.copy_(torch.where(fresh, torch.full_like(self.first_bad, step), self.first_bad))

    def check(self) -> None:
        """Every rank at the same steps: raise NonFiniteLoss if any rank saw a non-finite step
        (with ``continue``: warn on rank 0 and watch for the next one)."""
        first = self.first_bad.clone()
        first[first < 0] = torch.iinfo(torch.int64).max
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        step = int(first.item())
        if step == torch.iinfo(torch.int64).max:
            return
        if self.action == "continue":
            self.first_bad.fill_(-1)
            if dist.get_rank() == 0:
                print(f"trainer3d: warning: the loss or gradient norm is not finite (inf/nan) from step {step + 1}; "
                      "training goes on (train.on_nonfinite=continue)", flush=True)
            return
        raise NonFiniteLoss(
            f"the loss or gradient norm is not finite (inf/nan) at step {step + 1}; the run stopped without "
            "saving (train.on_nonfinite=stop): resume from the last checkpoint with a lower optim.lr, "
            "or set train.on_nonfinite=continue to train on")
