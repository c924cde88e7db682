"""AdamW on the pieces of the flat buffers this rank owns.

The state is three contiguous fp32 tensors of the owned length — ``exp_avg``,
``exp_avg_sq`` and, when the model is not fp32, the ``master`` weights — plus one step
counter. (For fp32 models the master weights are the parameter buffer's own slices.)

A ``Segment`` is the part of one parameter inside one owned piece: a contiguous range of
the parameter's flattened tensor. The update runs torch's fused AdamW kernel
(``torch._fused_adamw_``, the kernel behind ``AdamW(fused=True)``) on the lists of segment
views, once for the weight-decayed group and once for the rest: it allocates nothing, and
its ``found_inf`` argument skips an fp16 step on the device, with no host sync.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from trainer3d.config.schema import OptimConfig
from trainer3d.model.init import TPShard, tp_shard_of
from trainer3d.optim.schedule import decays


@dataclass
class Segment:
    """The owned part of one parameter: flat-buffer range and state-buffer offset."""

    name: str
    param: nn.Parameter
    start: int
    end: int
    """[start, end) in the flat parameter/gradient buffers."""
    param_start: int
    """Where the parameter starts in the flat buffers; start - param_start is the offset in
    the parameter's flattened local tensor."""
    state_offset: int
    """Where this segment starts in the owned-state buffers."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def local_range(self) -> Tuple[int, int]:
        """The owned range of the parameter's flattened local tensor (for checkpoints)."""
        return self.start - self.param_start, self.end - self.param_start

    @property
    def tp_shard(self) -> Optional[TPShard]:
        return tp_shard_of(self.param)


def segments_of(names: Dict[nn.Parameter, str], ranges: Dict[nn.Parameter, Tuple[int, int]],
                pieces: Sequence[Tuple[int, int]]) -> List[Segment]:
    """Intersect every parameter's flat range with the owned pieces (in flat order)."""
    out: List[Segment] = []
    state_offset = 0
    by_start = sorted(ranges.items(), key=lambda kv: kv[1][0])
    for lo, hi in pieces:
        for p, (start, end) in by_start:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out.append(Segment(names[p], p, a, b, start, state_offset + a - lo))
        state_offset += hi - lo
    return out


Group = Tuple[float, List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[torch.Tensor],
              List[torch.Tensor]]
"""One fused call's arguments: weight decay, then params, grads, exp_avgs, exp_avg_sqs, step counters."""


def adamw_groups(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                 exp_avg_sqs: List[torch.Tensor], decay: List[bool], step_count: torch.Tensor,
                 cfg: OptimConfig) -> List[Group]:
    """The tensors of each fused call, weight-decayed first (empty tensors and groups left out)."""
    groups = []
    for want, wd in ((True, cfg.weight_decay), (False, 0.0)):
        idx = [i for i, d in enumerate(decay) if d == want and params[i].numel()]
        if idx:
            groups.append((wd, [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                           [exp_avg_sqs[i] for i in idx], [step_count] * len(idx)))
    return groups


@torch.no_grad()
def fused_adamw_(groups: List[Group], step_count: torch.Tensor, lr: float, cfg: OptimConfig,
                 found_inf: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None) -> None:
    """AdamW on ``groups`` in place; the one step counter they share (the kernel only reads it)
    advanced unless ``found_inf`` (as torch's fused path does); ``grad_scale`` divides the
    gradients first (in place)."""
    step_count += 1
    for wd, params, grads, exp_avgs, exp_avg_sqs, steps in groups:
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                            weight_decay=wd, eps=cfg.eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                            found_inf=found_inf)
    if found_inf is not None:
        step_count -= found_inf.squeeze()


@torch.no_grad()
def adamw_update_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                  exp_avg_sqs: List[torch.Tensor], decay: List[bool], step_count: torch.Tensor, lr: float,
                  cfg: OptimConfig, found_inf: Optional[torch.Tensor] = None,
                  grad_scale: Optional[torch.Tensor] = None) -> None:
    """AdamW on lists of fp32 tensors in place, weight decay where ``decay``; one shared step
    counter (the kernel only reads it), advanced unless ``found_inf`` (as torch's fused path does).
    ``grad_scale``: the kernel divides the gradients by it first (in place)."""
    fused_adamw_(adamw_groups(params, grads, exp_avgs, exp_avg_sqs, decay, step_count, cfg), step_count, lr, cfg,
                 found_inf, grad_scale)


class FlatAdamW:
    """AdamW state for owned pieces of the flat buffers, and its fused update."""

    def __init__(self, segments: List[Segment], owned_numel: int, param_buffer: torch.Tensor,
                 grad_buffer: torch.Tensor, cfg: OptimConfig):
        self.segments, self.cfg = segments, cfg
        device = param_buffer.device
        self.exp_avg = torch.zeros(owned_numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(owned_numel, dtype=torch.float32, device=device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self.master: Optional[torch.Tensor] = None
        if param_buffer.dtype != torch.float32:
            self.master = torch.zeros(owned_numel, dtype=torch.float32, device=device)
        self.param_views = [param_buffer[s.start:s.end] for s in segments]
        self.grad_views = [grad_buffer[s.start:s.end] for s in segments]
        self.master_views = ([self._state_view(self.master, s) for s in segments] if self.master is not None
                             else self.param_views)
        self.exp_avg_views = [self._state_view(self.exp_avg, s) for s in segments]
        self.exp_avg_sq_views = [self._state_view(self.exp_avg_sq, s) for s in segments]
        if self.master is not None and segments:
            with torch.no_grad():
                torch._foreach_copy_(self.master_views, self.param_views)  # the model's values, as built
        self.decay = [decays(s.name, s.param) for s in segments]
        # The fused calls' lists, made once: the views and the counter are the same tensors every step.
        self.groups = adamw_groups(self.master_views, self.grad_views, self.exp_avg_views, self.exp_avg_sq_views,
                                   self.decay, self.step_count, cfg)

    @staticmethod
    def _state_view(buffer: torch.Tensor, s: Segment) -> torch.Tensor:
        return buffer[s.state_offset:s.state_offset + s.numel]

    @torch.no_grad()
    def step(self, lr: float, found_inf: Optional[torch.Tensor] = None) -> None:
        """One AdamW update of the owned master weights (skipped on the device if found_inf)."""
        fused_adamw_(self.groups, self.step_count, lr, self.cfg, found_inf)
        self.copy_master_to_params()

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        """The owned parameters := their master weights, cast (nothing to do in fp32)."""
        if self.master is not None and self.segments:
            torch._foreach_copy_(self.param_views, self.master_views)  # fp32 -> bf16/fp16

    def state_views(self) -> List[Tuple[Segment, Dict[str, torch.Tensor]]]:
        """Per owned segment, its views of the optimizer state by kind (``master`` only when it
        is a separate copy)."""
        out = []
        for i, s in enumerate(self.segments):
            kinds = {"exp_avg": self.exp_avg_views[i], "exp_avg_sq": self.exp_avg_sq_views[i]}
            if self.master is not None:
                kinds["master"] = self.master_views[i]
            out.append((s, kinds))
        return out
