"""Mixed precision: which dtype holds what, and fp16's dynamic loss scale.

``train.dtype`` is the dtype of the model's parameters, activations and per-micro-batch
gradients. Whatever it is, the optimizer keeps fp32 master weights and fp32 Adam moments,
and gradients are accumulated over micro-batches and reduced over dp in fp32 (as
Megatron-LM's distributed optimizer does with bf16: summing many micro-batches and dp
ranks in bf16 loses the small updates). fp32 training needs no separate master copy: the
fp32 parameters are the master weights.

fp16 has 5 exponent bits, so small gradients underflow: the loss is multiplied by a
dynamic scale before backward (Micikevicius et al. 2018, "Mixed Precision Training",
sec. 3.2). A step whose gradients hold an inf/nan is skipped on every rank (the global
gradient norm's all-reduce already tells every rank) and the scale halves; after
``growth_interval`` clean steps it doubles. All of it stays on the device: no host sync.
"""

from typing import Dict, Optional

import torch

from trainer3d.config.schema import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``train.dtype`` -> the dtype the model computes in."""


def param_dtype(cfg: Config) -> torch.dtype:
    """The dtype the model's parameters are built and stored in: ``train.dtype``, except under
    FSDP (ZeRO stages 2/3), whose sharded parameters are the fp32 master weights (it casts
    them to ``train.dtype`` as it gathers them for compute). Built in fp32 there, the masters
    start from the exact initial values, not from their rounding to ``train.dtype``."""
    return torch.float32 if cfg.parallel.zero_stage >= 2 else DTYPES[cfg.train.dtype]


class LossScaler:
    """The dynamic loss scale of fp16 training, as device tensors.

    ``found_inf`` is 1.0 when the step's global gradient norm is not finite; ``update``
    then halves the scale (and restarts the growth count), else counts a clean step and
    doubles the scale after ``growth_interval`` of them (torch's own kernel, the one
    ``torch.amp.GradScaler`` uses).
    """

    def __init__(self, device: torch.device, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = torch.full((1,), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((1,), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
        self.used_scale = self.scale.clone()  # the scale of the last finished step, for metrics
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale.squeeze(0)

    def inv_scale(self) -> torch.Tensor:
        return self.scale.reciprocal().squeeze(0)

    def check(self, global_norm: torch.Tensor) -> torch.Tensor:
        """Record whether this step overflowed (from the already all-reduced global norm)."""
        self.found_inf.copy_((~torch.isfinite(global_norm)).float().reshape(1))
        return self.found_inf

    def update(self) -> None:
        self.used_scale.copy_(self.scale)
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def metrics(self) -> Dict[str, torch.Tensor]:
        """Device tensors for metrics.jsonl: the scale this step used, and whether it was skipped."""
        return {"loss_scale": self.used_scale.squeeze(0).clone(), "skipped": self.found_inf.squeeze(0).bool()}

    def persistent(self) -> Dict[str, torch.Tensor]:
        """What a resumed run needs (saved and loaded in place by the checkpoint)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor the scaler holds (for memory accounting)."""
        return {**self.persistent(), "found_inf": self.found_inf, "used_scale": self.used_scale}


def make_loss_scaler(param_dtype: torch.dtype, device: torch.device, init_scale: float) -> Optional[LossScaler]:
    return LossScaler(device, init_scale) if param_dtype == torch.float16 else None
