"""The model section of the run's schema (``model.*``): a Llama-style decoder, its rotary
scaling and its mixture-of-experts blocks (docs/moe.md). Part of ``trainer3d.config.schema``, which re-exports both classes and registers the
whole schema with Hydra; the field docstrings under each field are what ``--help`` prints
(trainer3d/config/help.py).
"""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class RopeScalingConfig:
    """Rotary frequency scaling for contexts longer than pre-training's (Llama 3.1's "llama3"
    scheme: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between)."""

    type: str = "none"
    """none | llama3."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    """The context length the model was pre-trained with before scaling."""


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward blocks (trainer3d/model/moe.py, docs/moe.md): a router
    sends each token to ``top_k`` of ``num_experts`` SwiGLU experts (plus the always-on shared
    ones); ``num_experts`` 0 keeps every block dense."""

    num_experts: int = 0
    """Routed experts per MoE block; 0 = a dense model."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_ffn_dim: Optional[int] = None
    """Width of one expert's SwiGLU hidden layer; default model.ffn_dim."""
    num_shared_experts: int = 0
    """Always-on SwiGLU experts beside the routed ones (DeepSeekMoE), computed as one of
    num_shared_experts * expert_ffn_dim width."""
    first_dense_layers: int = 0
    """Leading blocks that stay dense (DeepSeek-V3 keeps its first three)."""
    every: int = 1
    """Every n-th block after first_dense_layers is MoE (1: all of them), the others dense."""
    router: str = "softmax_topk"
    """softmax_topk (Mixtral: softmax over experts, top-k, renormalised) | sigmoid_topk
    (DeepSeek-V3: sigmoid scores, top-k, normalised over the chosen)."""
    capacity_factor: float = 0.0
    """0 = dropless (no token dropped). > 0: each expert takes at most ceil(capacity_factor *
    tokens * top_k / num_experts) of a micro-batch's tokens on a rank and drops the rest, which
    depends on how tokens are split over ranks: layouts then train different models."""
    balance: str = "aux_loss"
    """aux_loss (Switch Transformer load-balancing loss) | aux_free (DeepSeek-V3 per-expert
    routing bias from the global batch's load) | none."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (balance=aux_loss)."""
    bias_update_rate: float = 0.001
    """Step of the per-expert bias update (balance=aux_free; DeepSeek-V3's gamma)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE); 0 = off."""


@dataclass
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, no biases."""

    name: str = "tiny"
    """The conf/model member this came from (for the record)."""
    dim: int = 128
    """Hidden size."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads; head_dim = dim / n_heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); equal to n_heads for plain multi-head."""
    head_dim: Optional[int] = None
    """Width of one attention head; default dim // n_heads."""
    ffn_dim: int = 384
    """Width of the SwiGLU hidden layer."""
    vocab_size: int = 257
    """Logical vocabulary; tensor parallelism pads it to a multiple of tp, padding masked out of the loss."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover (train.seq_len must not exceed it)."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    tie_embeddings: bool = False
    """The output head reuses the input embedding matrix (with pipelining, the first and last
    stage hold copies whose gradients are summed)."""
    init_std: float = 0.02
    """Std of the normal init; output projections are scaled by 1/sqrt(2 * n_layers)."""
    init_from: Optional[str] = None
    """A Hugging Face Llama directory (config.json + safetensors) to start from: the rest of
    this section is derived from its config.json before launch, and every rank reads its own
    slices of the weights. Explicit model.* overrides must agree with config.json."""
    bos_token_id: Optional[int] = None
    """Beginning-of-sequence token id, when known (from init_from's config.json); written into
    exported Hugging Face configs."""
    eos_token_ids: List[int] = field(default_factory=list)
    """End-of-sequence token id(s), when known (Llama 3 chat models have several)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
