"""The mixture-of-experts feed-forward block: a router, SwiGLU experts, shared experts.

Each token's hidden state goes to ``top_k`` of ``num_experts`` SwiGLU experts and comes back as
their gate-weighted sum (Shazeer et al. 2017; Fedus et al. 2022, "Switch Transformers"), plus
the always-on shared experts (Dai et al. 2024, "DeepSeekMoE"). Routing:

    softmax_topk  p = softmax(x Wr); the top_k of p, renormalised to sum to one (Mixtral: Jiang
                  et al. 2024; transformers' MixtralSparseMoeBlock)
    sigmoid_topk  s = sigmoid(x Wr); the top_k of s + b chosen (b: aux_free's bias, zero
                  otherwise), gated by s over the chosen s's sum (DeepSeek-V3, Liu et al. 2024,
                  sec. 2.1.2, eq. 13-16)

The experts run as one grouped matmul over the tokens sorted by expert
(``torch._grouped_mm`` with cumulative ``offs``, experts.py), never a loop over tokens.
Dropless by default; ``capacity_factor`` > 0 keeps at most ceil(cf * tokens * top_k / E)
tokens per expert, the first in token order, which depends on how a layout splits tokens.

Balancing (``balance``), each over one micro-batch's tokens:

    aux_loss  coef * E * sum_i f_i P_i, f_i the share of the T * top_k routed slots that went
              to expert i, P_i the mean router probability of i (Switch Transformers eq. 4-6;
              Megatron-LM's ``switch_load_balancing_loss_func`` normalises f the same way, so a
              balanced router scores 1; transformers' Mixtral loss is top_k times this)
    aux_free  no loss: a per-expert bias b added to the scores for the choice only, raised by
              ``bias_update_rate`` for experts under the mean load of the global batch and
              lowered for those above it, after each step (DeepSeek-V3 sec. 2.1.2;
              ``update_bias``)
    z-loss    z_coef * mean over tokens of logsumexp(x Wr)^2 (Zoph et al. 2022, "ST-MoE",
              eq. 5), beside either

The losses reach the gradients without reaching the model's output: ``_AuxLossGrad`` passes
the block's output through unchanged and, in backward, starts the aux loss's own backward
with ``aux_grad_scale`` (Megatron-LM's ``MoEAuxLossAutoScaler``,
megatron/core/transformer/moe/moe_utils.py). So the block is the same in every pipeline
schedule and the trainer's loss stays the language-model loss.

Parallelism is applied from outside, as for the dense block: a layout whose ranks each hold
part of a micro-batch's tokens (sequence or context parallelism) sets ``token_groups`` (the
counts are summed over it, so f is the micro-batch's) and ``token_ranks`` (the tokens are
``token_ranks`` times the local ones; P and the z-loss are local sums over all of them).
"""

from contextlib import contextmanager
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer3d.config.schema import ModelConfig
from trainer3d.model.experts import grouped_swiglu
from trainer3d.model.functional import swiglu_linear


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; backward also gives ``aux`` the gradient ``scale`` (Megatron-LM's
    ``MoEAuxLossAutoScaler``), times ``loss_scale`` where given: fp16's dynamic loss scale, a
    device tensor the optimizer updates only after the step's backwards (optim/mixed_precision.py),
    so the aux loss's gradient is scaled as the language-model loss's and unscaled with it.
    Nothing is saved for backward: the scalar's gradient needs only those factors."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float,
                loss_scale: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.scale, ctx.loss_scale = scale, loss_scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_aux = torch.full((), ctx.scale, dtype=torch.float32, device=grad_out.device)
        if ctx.loss_scale is not None:
            grad_aux = grad_aux * ctx.loss_scale.reshape(())
        return grad_out, grad_aux, None, None


def moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether block ``index`` is a mixture of experts (``first_dense_layers`` and ``every``)."""
    moe = cfg.moe
    if moe.num_experts == 0 or index < moe.first_dense_layers:
        return False
    return (index - moe.first_dense_layers) % moe.every == 0


def expert_ffn_dim(cfg: ModelConfig) -> int:
    return cfg.moe.expert_ffn_dim or cfg.ffn_dim


def ffn_params(cfg: ModelConfig, index: int, active: bool = False) -> int:
    """Weights of block ``index``'s feed-forward: the dense SwiGLU's, or the router's and the
    experts' (``active``: those one token uses, top_k routed experts and the shared ones)."""
    if not moe_layer(cfg, index):
        return 3 * cfg.dim * cfg.ffn_dim
    moe = cfg.moe
    experts = (moe.top_k if active else moe.num_experts) + moe.num_shared_experts
    return cfg.dim * moe.num_experts + 3 * cfg.dim * expert_ffn_dim(cfg) * experts


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as three 3-D weights, each expert's (in, out) matrix
    one slice: w1, w3 (E, dim, ffn), w2 (E, ffn, dim), the layout ``torch._grouped_mm`` reads."""

    EAGER_PARTS = ("_grouped",)
    """What train.compile leaves eager (model/experts.py; trainer3d/parallel/compile.py ``leave_eager``)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self._grouped = grouped_swiglu

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (tokens, dim) sorted by expert, ``counts[e]`` of them expert e's."""
        return self._grouped(x, self.w1, self.w3, self.w2, counts)


class SharedExperts(nn.Module):
    """The shared experts see every token: one SwiGLU as wide as all of them (DeepSeekMoE,
    Dai et al. 2024, sec. 3.2), replicated like the routed experts (tensor parallelism leaves
    an MoE block whole: parallel/tensor/layers.py)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_linear(self.w1(x), self.w3(x), self.w2.weight)


class MoE(nn.Module):
    """The block's feed-forward for (..., dim) hidden states, returning the same shape."""

    EAGER_PARTS = ("_account",)
    """What train.compile leaves eager (trainer3d/parallel/compile.py ``leave_eager``): the
    step's counts and the balance losses' hook are Python state dynamo would guard on."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.router_kind, self.balance = moe.router, moe.balance
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.bias_update_rate = moe.bias_update_rate
        self.router = nn.Linear(cfg.dim, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, cfg.dim, expert_ffn_dim(cfg))
        self.shared = None
        if moe.num_shared_experts:
            self.shared = SharedExperts(cfg.dim, moe.num_shared_experts * expert_ffn_dim(cfg))
        # aux_free's routing bias: state, not a parameter (no gradient; the optimizer never sees it).
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if moe.balance == "aux_free" else None)
        # One of the EAGER_PARTS. The function, not a bound method: a deep copy of the block
        # (parallel/pipeline/stages.py copies the model for each chunk of an interleaved rank)
        # must record into itself.
        self._account = MoE._record_and_attach
        self.aux_grad_scale = 1.0
        """The gradient the aux and z losses start backward from: the trainer's scale of a
        micro-batch's loss (1 / grad_accum; times cp: parallel/expert/tokens.py)."""
        self.loss_scale: Optional[torch.Tensor] = None
        """fp16's dynamic loss scale (the optimizer's scaler's tensor), which that gradient is
        multiplied by in backward; None without one."""
        self.token_groups: List[dist.ProcessGroup] = []
        """The groups a micro-batch's tokens are split over (parallel/expert/tokens.py)."""
        self.token_ranks = 1
        """How many ranks share a micro-batch's tokens: its tokens are that many times this rank's."""
        self.step_counts: Optional[torch.Tensor] = None
        """Tokens routed to each expert (int64, (E,)) by this rank's forwards since ``take_counts``."""
        self.last_aux_loss: Optional[torch.Tensor] = None
        """The balance loss (coefficient not applied) of the last forward with a gradient."""
        self.step_aux: Optional[torch.Tensor] = None
        """The sum of those losses over this rank's forwards since ``take_counts``."""
        self.counting = True
        """Whether a forward with a gradient is one of the step's (``not_counted``: a pipeline
        stage's shape inference runs the chunk once more on a stand-in micro-batch)."""

    def route(self, x: torch.Tensor):
        """Router logits (fp32), the chosen experts (T, k) and their gate weights (fp32)."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.router_kind == "softmax_topk" else logits.sigmoid()
        choice = scores + self.expert_bias if self.expert_bias is not None else scores
        chosen = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, chosen)
        return logits, scores, chosen, gates / gates.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, scores, chosen, gates = self.route(x)
        slots = chosen.reshape(-1)
        order = slots.argsort(stable=True)  # the T * k slots sorted by expert, token order within one
        counts = torch.bincount(slots, minlength=self.num_experts)
        if self.capacity_factor > 0:
            order, counts = self._drop_over_capacity(order, counts, x.shape[0])
        token = order // self.top_k
        y = self.experts(x[token], counts)
        out = torch.zeros_like(x).index_add_(0, token, y * gates.reshape(-1)[order, None].to(y.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        return self._account(self, out, logits, scores, slots).view(shape)

    # Eager under train.compile (parallel/compile.py): compiled with the block, the aux and z
    # losses' gradient does not reach the router (zero on CPU under torch 2.13's dynamo;
    # tests/unit/test_moe.py holds the compiled block to eager), and the counts are module
    # state a compiled graph would replay or bake in. The block's graph splits here; the
    # losses' gradient reaches the router's logits through the split as any gradient does.
    def _record_and_attach(self, out: torch.Tensor, logits, scores, slots) -> torch.Tensor:
        """Record the step's counts and attach the balance losses' backward to ``out``."""
        if self._counted():
            self._count(torch.bincount(slots, minlength=self.num_experts))
        aux = self._aux_losses(logits, scores, slots, out.shape[0]) if torch.is_grad_enabled() else None
        if aux is not None:
            out = _AuxLossGrad.apply(out, aux, self.aux_grad_scale, self.loss_scale)
        return out

    def _drop_over_capacity(self, order: torch.Tensor, counts: torch.Tensor, tokens: int):
        """Keep each expert's first ``capacity`` slots (GShard, Lepikhin et al. 2021, sec. 2.2)."""
        capacity = int(-(-self.capacity_factor * tokens * self.top_k // self.num_experts))
        starts = counts.cumsum(0) - counts
        experts = torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts)
        keep = torch.arange(order.numel(), device=order.device) - starts[experts] < capacity
        return order[keep], counts.clamp(max=capacity)

    def _counted(self) -> bool:
        """A forward of the step's own: with a gradient, not a recompute in backward (activation
        checkpointing), not a pipeline's shape inference."""
        return self.counting and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _count(self, counts: torch.Tensor) -> None:
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts

    def take_counts(self):
        """The routed counts and the summed balance losses since the last call (None where
        none), and a fresh start."""
        counts, aux, self.step_counts, self.step_aux = self.step_counts, self.step_aux, None, None
        return counts, aux

    def _aux_losses(self, logits, scores, slots, local_tokens: int) -> Optional[torch.Tensor]:
        """coef * balance loss + z_coef * z-loss of the micro-batch, as this rank's share: a sum
        over its tokens that, summed over ``token_group``, is the micro-batch's loss."""
        terms = []
        tokens = local_tokens * self.token_ranks
        if self.balance == "aux_loss" and self.aux_loss_coef > 0:
            with torch.no_grad():
                counts = torch.bincount(slots, minlength=self.num_experts).to(torch.float32)
                for group in self.token_groups:
                    dist.all_reduce(counts, group=group)
                f = counts / (tokens * self.top_k)
            probs = scores if self.router_kind == "softmax_topk" else scores / scores.sum(-1, keepdim=True)
            balance = self.num_experts * (f * probs.sum(0)).sum() / tokens
            self.last_aux_loss = balance.detach()
            if self._counted():
                self.step_aux = self.last_aux_loss if self.step_aux is None else self.step_aux + self.last_aux_loss
            terms.append(self.aux_loss_coef * balance)
        if self.z_loss_coef > 0:
            terms.append(self.z_loss_coef * logits.logsumexp(-1).square().sum() / tokens)
        return sum(terms) if terms else None

    def reset_bias(self, device: torch.device) -> None:
        """aux_free's bias at its start: zero and fp32 on ``device`` (after the model is
        materialised from the meta device and cast, which leave a buffer unset and in the
        parameters' dtype; DeepSeek-V3 keeps it apart from the model's precision)."""
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=device)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """aux_free: b_i += rate * sign(mean load - load_i), from the global batch's ``counts``
        (DeepSeek-V3 sec. 2.1.2: lowered for overloaded experts, raised for underloaded ones)."""
        load = counts.to(self.expert_bias.dtype)
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))


@contextmanager
def not_counted(blocks: List[MoE]):
    """Forwards inside are no micro-batch of the step: their counts and losses are not recorded."""
    for block in blocks:
        block.counting = False
    try:
        yield
    finally:
        for block in blocks:
            block.counting = True


def moe_blocks(chunks) -> List[MoE]:
    """The MoE feed-forwards of this rank's model chunks, in layer order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoE)]

