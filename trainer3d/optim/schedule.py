"""Learning-rate schedule and AdamW parameter groups (shared by every ZeRO stage)."""

import math
from typing import Iterable, List, Tuple

import torch

from trainer3d.config.schema import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``.

    A pure function of the step, so resuming needs no scheduler state.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay on matrices and embeddings; none on norm weights (1-D)."""
    return param.ndim >= 2


def param_groups(named_params: Iterable[Tuple[str, torch.Tensor]], weight_decay: float) -> List[dict]:
    named = list(named_params)
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]

