"""The FLOP count behind TFLOP/s and MFU, against a count done by hand."""

from trainer3d.config.schema import ModelConfig
from trainer3d.model.flops import flops_per_token, peak_tflops


def test_tiny_model_by_hand():
    cfg = ModelConfig()  # tiny: dim 128, 4 layers, 4 heads (head dim 32), 2 kv-heads, ffn 384, vocab 257
    seq = 128
    wq = wo = 128 * 128
    wk = wv = 128 * 64          # 2 kv-heads x 32
    ffn = 3 * 128 * 384         # w1, w3, w2
    head = 128 * 257
    forward_matmuls = 2 * (4 * (wq + wk + wv + wo + ffn) + head)   # 1,638,656
    scores = 4 * (2 * seq * 128 + 2 * seq * 128)                    # QK^T and AV: 262,144
    assert flops_per_token(cfg, seq) == 3 * (forward_matmuls + scores) == 5_702_400


def test_six_n_rule_at_scale():
    """For a large model with short sequences, 6 x parameters dominates (Kaplan et al. 2020)."""
    cfg = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000)
    n_params = 6_738_415_616  # Llama-2 7B, with its embedding
    ratio = flops_per_token(cfg, 128) / (6 * n_params)
    assert 0.98 < ratio < 1.01


def test_peak_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("cpu", "fp32") is None
