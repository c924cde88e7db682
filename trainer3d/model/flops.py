"""FLOPs of a training step, for TFLOP/s and MFU (model FLOPs utilisation).

Model FLOPs, as in PaLM (Chowdhery et al. 2022, appendix B): a multiply-add is 2 FLOPs; the
backward pass costs twice the forward; recomputation (activation checkpointing) is *not*
counted, so MFU compares layouts and settings fairly. Per token, per layer, forward:

- every weight matrix W (in x out) costs 2 * in * out;
- attention scores Q K^T and the weighted sum A V each cost 2 * seq * (n_heads * head_dim)
  (full seq x seq, as PaLM counts it, though the causal mask could skip half);

plus the output head, 2 * dim * vocab. A mixture-of-experts block counts the weights a token
uses: the router, its top_k experts and the shared ones (model/moe.py ``ffn_params``), as
Megatron-LM's ``num_floating_point_operations`` does for MoE. The embedding lookup and norms are not matmuls and
are left out (under 0.1% at any real size). Training = 3 x forward.
"""

from typing import Optional

from trainer3d.config.schema import ModelConfig
from trainer3d.model.moe import ffn_params
from trainer3d.model.transformer import head_dim_of


def layer_matmul_params(cfg: ModelConfig, index: int = 0) -> int:
    """Weights of block ``index`` that take part in a token's matrix multiplies (all but its
    norms; of an MoE block, the active ones)."""
    head_dim = head_dim_of(cfg)
    attention = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)  # wq, wo + wk, wv
    return attention + ffn_params(cfg, index, active=True)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a token's matrix multiplies (all but the embedding and norms;
    a tied head is the embedding matrix, but it still multiplies; MoE blocks' active ones)."""
    return sum(layer_matmul_params(cfg, i) for i in range(cfg.n_layers)) + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Model FLOPs of forward + backward for one token of a seq_len-token sequence."""
    attention_scores = cfg.n_layers * 2 * (2 * seq_len * cfg.n_heads * head_dim_of(cfg))
    return 3 * (2 * matmul_params(cfg) + attention_scores)


# Dense peak TFLOP/s per GPU by name fragment (vendor data sheets, no sparsity).
_PEAK_TFLOPS = {
    # name fragment: {dtype: peak}
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}


def peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The data-sheet peak for this device and dtype, or None where unknown (e.g. CPUs)."""
    for fragment, peaks in _PEAK_TFLOPS.items():
        if fragment in device_name:
            return peaks.get(dtype) or None
    return None
