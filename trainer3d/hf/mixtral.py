"""Hugging Face Mixtral (``MixtralForCausalLM``): what differs from Llama, read in both directions.

The attention, norms and embeddings are Llama's (trainer3d/hf/mapping.py NAMES). Each block's
feed-forward is a mixture of experts (trainer3d/model/moe.py), stored as transformers'
``save_pretrained`` writes it (transformers 5 fuses the experts into 3-D ``mlp.experts.gate_up_proj``
in memory but converts them back on save, transformers/conversion_mapping.py "mixtral"):

- ``model.layers.{i}.block_sparse_moe.gate.weight`` [E, hidden]: the router, trainer3d's
  ``feed_forward.router.weight`` as it is;
- ``model.layers.{i}.block_sparse_moe.experts.{e}.w1|w3.weight`` [ffn, hidden] and ``w2.weight``
  [hidden, ffn]: nn.Linear weights (y = x W^T), so expert e of trainer3d's 3-D
  ``feed_forward.experts.w1`` (E, hidden, ffn), applied as x @ w1[e], is ``w1.weight``
  transposed; w1 is the silu branch, w3 the up projection, w2 the down projection.

The router is the same: softmax over all experts, the top k kept and renormalised
(transformers' ``MixtralTopKRouter``; trainer3d's ``softmax_topk``). transformers' aux loss is
top_k times trainer3d's (docs/moe.md, Balancing): ``aux_loss_coef = top_k * router_aux_loss_coef``.
"""

import re
from typing import Any, Dict, List, Optional, Tuple

import torch

FIXED = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu"}

OURS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
THEIRS = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
ROUTER = ("layers.{i}.feed_forward.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight")


def is_mixtral(config: dict) -> bool:
    return config.get("model_type") == "mixtral" or config.get("architectures") == FIXED["architectures"]


def expert_names(name: str, num_experts: int) -> Optional[List[str]]:
    """The per-expert Hugging Face names of a trainer3d 3-D expert weight, or None for any other name."""
    match = OURS.match(name)
    if match is None:
        return None
    layer, which = match.groups()
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{which}.weight" for e in range(num_experts)]


def from_hf_expert(name: str) -> Optional[Tuple[str, int]]:
    """(trainer3d's 3-D weight, expert index) for a per-expert Hugging Face name, else None."""
    match = THEIRS.match(name)
    if match is None:
        return None
    layer, expert, which = match.groups()
    return f"layers.{layer}.feed_forward.experts.{which}", int(expert)


def split_experts(weight: torch.Tensor) -> List[torch.Tensor]:
    """A 3-D (E, in, out) expert weight as E nn.Linear weights (out, in), bit for bit."""
    return [w.t().contiguous() for w in weight.unbind(0)]


def join_experts(weights: List[torch.Tensor]) -> torch.Tensor:
    """E nn.Linear weights (out, in) (or blocks of them) as the 3-D (E, in, out), bit for bit."""
    return torch.stack([w.t() for w in weights]).contiguous()


# ----------------------------------------------------------------------------- config.json

def moe_fields(config: dict, typed, problems: List[str]) -> Dict[str, Any]:
    """model.moe's fields from a Mixtral config.json (``typed``: mapping.py's checker)."""
    out: Dict[str, Any] = {"router": "softmax_topk", "expert_ffn_dim": None, "num_shared_experts": 0,
                           "first_dense_layers": 0, "every": 1}
    for field, key, default in (("num_experts", "num_local_experts", 8), ("top_k", "num_experts_per_tok", 2)):
        value = typed(field, key, config.get(key, default), problems)
        if value is not None and value < 1:
            problems.append(f"config.json: {key}={value} must be a positive integer")
        out[field] = value
    coef = typed("aux_loss_coef", "router_aux_loss_coef", config.get("router_aux_loss_coef", 0.001), problems)
    if coef is not None and out["top_k"]:
        out["aux_loss_coef"] = out["top_k"] * coef
    jitter = config.get("router_jitter_noise") or 0.0
    if jitter != 0.0:
        problems.append(f"config.json: router_jitter_noise={jitter!r} is not supported (trainer3d's router "
                        "adds no noise); a checkpoint trained with it still imports once it is 0")
    return out


def sliding_window_problem(config: dict, seq_len: int) -> Optional[str]:
    """A sliding window shorter than the training sequence: trainer3d attends over the whole
    sequence, which equals the window only while no sequence is longer than it."""
    window = config.get("sliding_window")
    if window is None or window >= seq_len:
        return None
    return (f"config.json: sliding_window={window} is smaller than train.seq_len={seq_len}; trainer3d has no "
            f"sliding-window attention: set train.seq_len<={window}")


def hf_moe_config(moe) -> Dict[str, Any]:
    """The Mixtral keys of config.json for trainer3d's ``model.moe``."""
    return {**FIXED, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef / moe.top_k, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def mixtral_problems(cfg) -> List[str]:
    """What a Mixtral checkpoint cannot say about a ModelConfig's ``model.moe`` (export refuses it)."""
    moe, problems = cfg.moe, []
    if moe.router != "softmax_topk":
        problems.append(f"model.moe.router={moe.router} (Mixtral's router is softmax_topk)")
    if moe.num_shared_experts or moe.first_dense_layers or moe.every != 1:
        problems.append("shared experts or dense blocks (Mixtral has routed experts in every block)")
    if moe.expert_ffn_dim not in (None, cfg.ffn_dim):
        problems.append(f"model.moe.expert_ffn_dim={moe.expert_ffn_dim} (Mixtral's experts are intermediate_size "
                        "wide: set model.ffn_dim instead)")
    if moe.capacity_factor > 0:
        problems.append(f"model.moe.capacity_factor={moe.capacity_factor} (Mixtral is dropless)")
    return problems
