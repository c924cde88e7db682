"""conf/model/ mixture-of-experts presets: Mixtral-8x7B's published size and the laptop one.

Mistral AI gives Mixtral-8x7B as 46.7B parameters of which 12.9B are used per token
(https://mistral.ai/news/mixtral-of-experts); the hub's ``safetensors.total`` for
mistralai/Mixtral-8x7B-v0.1 is 46,702,792,704. Both figures include the embedding and the
output projection. The active count is a hand count below, not the code's own formula.
"""

import torch

from tests.unit.test_presets import _training
from trainer3d.config.validate import validate
from trainer3d.model.moe import ffn_params
from trainer3d.model.transformer import Transformer, count_parameters


def _hand_count(dim, layers, heads, kv_heads, head_dim, ffn, vocab, experts, used):
    attention = dim * head_dim * (2 * heads + 2 * kv_heads)
    expert = 3 * dim * ffn  # w1, w3, w2
    per_layer = attention + dim * experts + used * expert + 2 * dim  # router, experts, two RMSNorms
    return layers * per_layer + 2 * vocab * dim + dim  # untied embedding and output, final norm


def test_mixtral_8x7b_has_the_published_parameter_counts():
    cfg = _training(["model=mixtral-8x7b"]).model
    with torch.device("meta"):
        built = sum(p.numel() for p in Transformer(cfg).parameters())
    shape = (4096, 32, 32, 8, 128, 14336, 32000, 8)
    assert built == _hand_count(*shape, used=8) == 46_702_792_704  # the hub's safetensors total
    assert count_parameters(cfg) == built
    active = _hand_count(*shape, used=2)
    assert round(built / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9
    # what the planner's FLOPs count per token (model/moe.py ffn_params, active=True)
    layers = sum(ffn_params(cfg, i, active=True) for i in range(cfg.n_layers))
    assert count_parameters(cfg) - sum(ffn_params(cfg, i) for i in range(cfg.n_layers)) + layers == active


def test_tiny_moe_composes_validates_and_is_small():
    cfg = validate(_training(["model=tiny-moe", "parallel=dp2"]))
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.top_k == 2
    with torch.device("meta"):
        built = sum(p.numel() for p in Transformer(cfg.model).parameters())
    assert built == _hand_count(64, 4, 4, 2, 16, 128, 257, 4, used=4) and 300_000 < built < 1_000_000


def test_deepseekmoe_16b_has_the_published_parameter_counts():
    """DeepSeekMoE 16B (arXiv:2401.06066, sec. 5: 16.4B parameters, 2.8B activated; the
    embedding and output included): 28 blocks of 2048, 16 heads of 128; block 0 dense (FFN
    10944), the 27 others 64 routed experts of 1408, top-6, beside 2 shared ones of 1408."""
    cfg = _training(["model=deepseekmoe-16b"]).model
    with torch.device("meta"):
        built = sum(p.numel() for p in Transformer(cfg).parameters())
    dim, vocab, layers, expert = 2048, 102400, 28, 3 * 2048 * 1408
    attention, norms = 2048 * 128 * (16 + 16 + 16 + 16), 2 * dim
    dense = attention + norms + 3 * dim * 10944
    moe = attention + norms + dim * 64 + 2 * expert  # router, the shared experts

    def total(used):
        return dense + (layers - 1) * (moe + used * expert) + 2 * vocab * dim + dim

    assert built == total(64) and count_parameters(cfg) == built
    assert round(built / 1e9, 1) == 16.4 and round(total(6) / 1e9, 1) == 2.8
    layers_active = sum(ffn_params(cfg, i, active=True) for i in range(cfg.n_layers))
    assert count_parameters(cfg) - sum(ffn_params(cfg, i) for i in range(cfg.n_layers)) + layers_active == total(6)
