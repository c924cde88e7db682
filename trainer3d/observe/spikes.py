"""Loss spikes: each step judged against a robust statistic of the steps before it.

A spike is a step whose loss, or global gradient norm, lies above the median of the last
``train.spike.window`` judged steps by more than ``train.spike.threshold`` robust standard
deviations (1.4826 x the median absolute deviation, MAD: the scale of a normal distribution
whose MAD it is; Hampel's outlier rule). Median and MAD, unlike a mean and a standard
deviation, are not dragged by the spikes they are meant to find. Nothing is judged before
``train.spike.min_steps`` steps were seen, and a spike never enters the history.

The window is saved in every checkpoint's marker (``spike``) and taken up on resume and on
rollback, so a resumed run judges each step as the uninterrupted run would.

The decision is the same on every rank because its inputs are: one all-reduce per step
carries the loss (summed over the ranks that own one, the last stage's tp rank 0 of every
dp x cp replica, divided by dp x cp: the same mean metrics.jsonl writes) and the gradient
norm (rank 0's value, the others adding zero, so every rank reads rank 0's bits). An
all-reduce leaves the same bits on every rank, and the history is a function of those values
alone. That read is a host sync per step, which ``train.spike.policy=off`` avoids.

A non-finite loss or norm is not judged here: trainer3d/observe/nonfinite.py owns it
(``train.on_nonfinite``), and it does not enter the history.

Background: PaLM (Chowdhery et al. 2022, sec. 5.1) restarted ~100 steps before a spike and
skipped 200-500 batches; OLMo 2 (OLMo et al. 2024, sec. 3.2) tracks spikes of the loss and
the gradient norm as the measures of training stability.
"""

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional

import torch
import torch.distributed as dist

from trainer3d.config.schema import SpikeConfig
from trainer3d.data.skips import SkipLog

ROBUST_SIGMA = 1.4826
"""A normal distribution's standard deviation over its median absolute deviation."""


@dataclass(frozen=True)
class Verdict:
    step: int
    loss: float
    grad_norm: float
    reason: Optional[str]
    """None: not a spike; else which statistic spiked and by how much."""


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def robust_excess(history: List[float], value: float) -> float:
    """How many robust standard deviations ``value`` lies above the median of ``history``
    (inf above a constant history, 0 at or below its median)."""
    median = _median(history)
    if value <= median:
        return 0.0
    scale = ROBUST_SIGMA * _median([abs(v - median) for v in history])
    return (value - median) / scale if scale > 0 else math.inf


class SpikeWatch:
    """``judge(step, loss, grad_norm)`` on every rank, after the step's gradient norm and before
    its update: the agreed Verdict (None with the policy off)."""

    def __init__(self, cfg: SpikeConfig, loss_owner: bool, dp_cp: int, rank: int):
        self.cfg = cfg
        self.loss_owner = loss_owner
        """This rank's loss is one of the dp x cp replicas' (the last stage, tp rank 0)."""
        self.dp_cp, self.rank = dp_cp, rank
        self.losses: Deque[float] = deque(maxlen=cfg.window)
        self.norms: Deque[float] = deque(maxlen=cfg.window)
        self.seen = 0

    def state(self) -> dict:
        """The window, for a checkpoint's marker: a resumed run judges its next step against the
        same history an uninterrupted run would (JSON floats read back to the same bits)."""
        return {"losses": list(self.losses), "norms": list(self.norms), "seen": self.seen}

    def restore(self, state: Optional[dict]) -> None:
        """Take up ``state`` (a marker's ``spike``; None, from a checkpoint without one: start
        empty). A window shorter than the saved history keeps its newest steps."""
        self.losses.clear()
        self.norms.clear()
        self.seen = 0
        if not isinstance(state, dict):
            return
        losses, norms, seen = state.get("losses"), state.get("norms"), state.get("seen")
        if not (isinstance(losses, list) and isinstance(norms, list) and len(losses) == len(norms)
                and type(seen) is int and all(isinstance(v, (int, float)) for v in losses + norms)):
            return
        self.losses.extend(float(v) for v in losses)
        self.norms.extend(float(v) for v in norms)
        self.seen = seen

    @property
    def acting(self) -> bool:
        return self.cfg.policy != "off"

    def agreed(self, loss: Optional[torch.Tensor], grad_norm: torch.Tensor) -> List[float]:
        """[mean loss over dp x cp, rank 0's gradient norm], the same bits on every rank."""
        own = loss.detach().float() if (loss is not None and self.loss_owner) else grad_norm.new_zeros((), dtype=torch.float32)
        norm = grad_norm.detach().float() if self.rank == 0 else torch.zeros_like(own)
        packed = torch.stack([own, norm.to(own.device)])
        dist.all_reduce(packed)
        mean_loss, norm_value = packed.tolist()
        return [mean_loss / self.dp_cp, norm_value]

    def judge(self, step: int, loss: Optional[torch.Tensor], grad_norm: torch.Tensor) -> Optional[Verdict]:
        if not self.acting:
            return None
        mean_loss, norm = self.agreed(loss, grad_norm)
        return self.judge_values(step, mean_loss, norm)

    def judge_values(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """The verdict on values already agreed; the history grows by a step that is not a spike."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Verdict(step, loss, grad_norm, None)  # the non-finite watch's business
        reasons = []
        if self.seen >= self.cfg.min_steps and len(self.losses) >= 3:
            for name, history, value in (("loss", self.losses, loss), ("grad_norm", self.norms, grad_norm)):
                excess = robust_excess(list(history), value)
                if excess > self.cfg.threshold:
                    reasons.append(f"{name} {value:.4g} is {excess:.1f} robust sd above the median "
                                   f"{_median(list(history)):.4g} of the last {len(history)} steps")
        self.seen += 1
        if reasons:
            return Verdict(step, loss, grad_norm, "; ".join(reasons))
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return Verdict(step, loss, grad_norm, None)


class SpikeResponse:
    """What a spike's verdict makes the run do, by ``train.spike.policy``: recorded in the skip
    log (trainer3d/data/skips.py), said on rank 0, and for ``rollback`` the restore.

    ``choose(first)``: every rank, the agreed checkpoint at or before step ``first`` (an object
    with ``.step``; None where there is none: trainer3d/checkpoint/rollback.py); ``restore(choice)``:
    every rank loads it and returns the step to go on from. The trainer passes both, so this
    module needs no checkpoint code."""

    def __init__(self, cfg: SpikeConfig, skips: SkipLog, say: Callable[[str], None],
                 choose: Callable[[int], Optional[Any]], restore: Callable[[Any], int]):
        self.cfg, self.skips, self.say = cfg, skips, say
        self.choose, self.restore = choose, restore

    def act(self, verdict: Verdict) -> Optional[int]:
        """The step to go on from after a rollback, else None."""
        s = self.cfg
        event = {"step": verdict.step, "loss": verdict.loss, "grad_norm": verdict.grad_norm, "reason": verdict.reason}
        if s.policy == "warn":
            self.say(f"loss spike at step {verdict.step}: {verdict.reason}; training on (train.spike.policy=warn)")
            self.skips.add([], {**event, "action": "warn"})
            return None
        if s.policy == "rollback":
            first = max(0, verdict.step - s.skip_window + 1)
            choice = self.choose(first)
            if choice is not None:
                skipped = list(range(max(first, choice.step), verdict.step + 1))
                self.skips.add(skipped, {**event, "action": f"rollback to step {choice.step}, skip steps "
                                                             f"{skipped[0]}-{skipped[-1]}"})
                self.say(f"loss spike at step {verdict.step}: {verdict.reason}; rolling back to the checkpoint "
                         f"of step {choice.step} and skipping steps {skipped[0]}-{skipped[-1]} "
                         f"(train.spike.policy=rollback, skip_window={s.skip_window})")
                return self.restore(choice)
            self.say(f"loss spike at step {verdict.step}: no checkpoint at or before step {first} to roll back to; "
                     "its update is skipped instead (checkpoint.every sets how often there is one)")
        self.skips.add([verdict.step], {**event, "action": "skip"})
        if s.policy == "skip":
            self.say(f"loss spike at step {verdict.step}: {verdict.reason}; its update skipped "
                     "(train.spike.policy=skip)")
        return None
