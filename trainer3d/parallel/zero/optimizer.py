"""The optimizer contract: everything the trainer, checkpoints and metrics may ask of the
data-parallel optimizer, whichever ZeRO stage implements it.

Five implementations, which ``parallel/parallelize.py`` (``build_optimizer``) chooses from
``parallel.zero_stage``, ``parallel.offload_optimizer`` and ``parallel.ep``: stages 0/1
(``FlatZeroOptimizer``, parallel/zero/flat.py: flat buffers, bucketed reduction;
``ReplicatedOptimizer`` and ``ShardedOptimizer``; AdamW, or with ``optim.name=muon`` Muon for
the blocks' matrices), their offloaded form (``OffloadedOptimizer``, parallel/zero/offload.py:
fp32 state and the AdamW step on the host), stages 2/3 (``FSDPOptimizer``, parallel/zero/fsdp.py:
FSDP2) and theirs (``OffloadedFSDPOptimizer``, parallel/zero/fsdp_offload.py: FSDP2's CPU
offload), and under expert parallelism stages 0/1 twice over (``ExpertParallelOptimizer``,
parallel/expert/optimizer.py: the dense parameters over dp x cp, the experts' slices over their
expert-dp group). Code outside those modules reaches an optimizer through these methods only.

One step, as trainer3d/trainer.py runs it::

    opt.zero_grad()
    (opt.scale_loss(loss) / grad_accum).backward()   # every micro-batch
    opt.reduce_gradients()                           # dp reduction done (fp16: unscaled), and then
                                                     # the tp and tied-embedding sums of opt.grad(p):
                                                     # both in GradFinalizer (parallel/finalize.py),
                                                     # which names the changed ones (grads_changed)
    norm = opt.clip_grad_norm(max_norm)              # global norm, each element counted once
    opt.step(lr)                                     # ZeRO-1: parameters gathered during the next forward
    opt.step_metrics()                               # device tensors for metrics.jsonl

Checkpoints (trainer3d/checkpoint/state.py) read and write this rank's state in place
through ``checkpoint_views`` plus ``step_count`` and ``scaler``, then call ``after_load``.
Memory accounting (trainer3d/observe/telemetry.py) counts ``state_tensors``.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from trainer3d.model.init import TPShard
from trainer3d.optim.mixed_precision import LossScaler

STATE_KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "momentum_buffer")
TERMS = ("params", "grads", "master", "optimizer")


@dataclass(frozen=True)
class StateView:
    """Elements ``[start, end)`` of the flattened tp-local tensor of parameter ``name`` and
    the tensors of this rank that hold them.

    ``tensors`` maps a kind of ``STATE_KINDS`` to a flat view of ``end - start`` elements:
    ``param`` the model's values, ``master`` the fp32 master weights (only where they are not
    the parameters themselves), ``exp_avg`` and ``exp_avg_sq`` AdamW's moments. Writing into
    a view writes the optimizer's own storage (that is how a checkpoint loads);
    ``momentum_buffer`` Muon's momentum, held instead of the moments for a Muon matrix
    (parallel/zero/muon.py)."""

    name: str
    """The parameter's name in the 1-rank model (``layers.0.attention.wq.weight``)."""
    local_shape: Tuple[int, ...]
    """Shape of the parameter's tensor-parallel slice on this rank (the full shape at tp=1)."""
    tp_shard: Optional[TPShard]
    """Which tensor-parallel slice that is; None for a parameter replicated over tp."""
    start: int
    end: int
    tensors: Dict[str, torch.Tensor]


class ZeroOptimizer(ABC):
    """The step's optimizer (AdamW, or Muon and AdamW) with fp32 state over this rank's model chunks,
    data-parallel over ``dims.dp_cp_group`` (dp x cp; expert slices over their expert-dp group)."""

    step_count: torch.Tensor
    """Optimizer steps taken (a device scalar; skipped fp16 steps do not count)."""
    scaler: Optional[LossScaler]
    """fp16's dynamic loss scale; None for fp32 and bf16."""

    @abstractmethod
    def parameters(self) -> List[torch.nn.Parameter]:
        """The parameters it trains, as the model holds them between steps (tp marks on)."""

    # ---------------------------------------------------------------- one step

    @abstractmethod
    def zero_grad(self) -> None:
        """Start a step: no gradient left from the previous one."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from (fp16 multiplies by the dynamic loss scale)."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    @abstractmethod
    def reduce_gradients(self) -> None:
        """After the step's last backward: finish the dp reduction (fp16: and unscale)."""

    @abstractmethod
    def grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's part of ``param``'s reduced gradient, a plain tensor the step reads:
        an in-place change to it (the sequence-parallel sync) is what the step uses."""

    def grads_changed(self, params: List[torch.nn.Parameter]) -> None:  # noqa: B027  (no-op unless offloaded)
        """After ``reduce_gradients``: these parameters' ``grad`` views were changed in place (the
        tp and tied-embedding sums); an optimizer holding a copy of them (offload) takes it again."""

    shards_state: bool = False
    """Each dp rank owns (updates) only part of every gradient: ZeRO 1-3."""

    def owned_ranges(self, param: torch.Tensor) -> List[Tuple[int, int]]:
        """The ``[start, end)`` ranges of ``grad(param)`` flattened whose update this rank owns
        (all of it unless the state is sharded over dp)."""
        grad = self.grad(param)
        return [(0, grad.numel())] if grad is not None else []

    @abstractmethod
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm over tp, pp and dp (one all-reduce, every element of the
        full model's gradient counted once); scales the gradients to at most ``max_norm``
        (0: no clipping). fp16: a non-finite norm marks the step to be skipped."""

    @abstractmethod
    def step(self, lr: float) -> None:
        """One AdamW update of this rank's fp32 state; the model's parameters follow by the
        time their module's next forward runs (ZeRO-1 gathers them meanwhile), and at once
        after ``wait_params``."""

    def wait_params(self) -> None:  # noqa: B027  (a no-op where nothing is gathered late)
        """The model's parameters hold the last step's values: for a reader that is not a
        module's forward (the methods of this contract that return parameters or state
        views wait by themselves)."""

    def step_metrics(self) -> Dict[str, torch.Tensor]:
        """Device tensors for metrics.jsonl (fp16: loss_scale and skipped)."""
        return self.scaler.metrics() if self.scaler is not None else {}

    # ---------------------------------------------------------------- checkpoints

    @abstractmethod
    def checkpoint_views(self) -> List[StateView]:
        """Views of everything this rank holds of the model and optimizer state, each element
        of a kind in exactly one view (replicas over dp or tp hold the same elements)."""

    @abstractmethod
    def after_load(self) -> None:
        """Make the model's parameters follow the state a checkpoint loaded into the views
        (the cast of the fp32 masters, gathered over dp where each rank loaded a shard)."""

    # ---------------------------------------------------------------- memory

    @abstractmethod
    def state_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """The tensors this optimizer holds, by term of trainer3d/memory/states.py (``TERMS``):
        params (the model's storage it manages), grads, master, optimizer (moments, step
        counter, loss scaler)."""

    def _scalar_tensors(self) -> List[torch.Tensor]:
        scaler = list(self.scaler.tensors().values()) if self.scaler is not None else []
        return [self.step_count, *scaler]
