"""The two scalars a host AdamW step needs from the device: the gradients' divisor and fp16's
skip flag.

Where the optimizer state lives on the host (parallel/zero/offload.py for ZeRO 0/1,
parallel/zero/fsdp_offload.py for ZeRO 2/3), the global norm is still reduced on the device
(its all-reduce is a device collective). The clip coefficient and fp16's inverse loss scale
become one divisor that the host kernel applies as it reads the gradients (``grad_scale`` of
``torch._fused_adamw_``), so the host never scales the gradients in a pass of their own, and
fp16's ``found_inf`` becomes the kernel's skip flag. Both cross to the host in one copy,
after the gradients, as the host step needs them anyway.
"""

from typing import Optional, Tuple

import torch

from trainer3d.parallel.clip import clip_by_global_norm_
from trainer3d.optim.mixed_precision import LossScaler


def clip_divisor(local_sq: torch.Tensor, max_norm: float,
                 scaler: Optional[LossScaler]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(global norm, the divisor of the still-scaled gradients or None) from this rank's
    share of the squared norm of the scaled gradients (fp16: scaled by the loss scale), a
    device scalar. fp16: a non-finite norm marks the step to be skipped."""
    inv_scale = scaler.inv_scale() if scaler is not None else None
    if inv_scale is not None:
        local_sq = local_sq * inv_scale * inv_scale
    norm = clip_by_global_norm_(local_sq, [], max_norm)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None
    if inv_scale is not None:
        factor = inv_scale if factor is None else factor * inv_scale
        scaler.check(norm)
    return norm, factor.reciprocal() if factor is not None else None


class HostScalars:
    """A two-element host buffer (pinned on CUDA) the divisor and skip flag are copied into."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.zeros(2, dtype=torch.float32, pin_memory=device.type == "cuda")

    def fetch(self, divisor: Optional[torch.Tensor],
              scaler: Optional[LossScaler]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(grad_scale, found_inf) for the host kernel, as host tensors (None where not needed).
        A divisor of exactly 1 (no clipping this step, no loss scale) is left out: the kernel
        would otherwise write every gradient back after dividing it, one more pass over memory."""
        if divisor is None and scaler is None:
            return None, None
        one = torch.ones((), device=self.device)
        pair = torch.stack([divisor if divisor is not None else one,
                            scaler.found_inf.squeeze(0) if scaler is not None else one * 0])
        self.buffer.copy_(pair, non_blocking=self.buffer.is_pinned())
        if self.buffer.is_pinned():
            torch.cuda.current_stream(self.device).synchronize()
        divides = divisor is not None and bool(self.buffer[0] != 1)
        return (self.buffer[0:1] if divides else None), (self.buffer[1:2] if scaler is not None else None)
