"""The GPU step-time terms (trainer3d/plan/kernels.py, block_time.py): GEMMs by shape against
the published measurement they are anchored to and hand-counted quantisation, attention
kernels, host launches, and ZeRO-3's one collective per sharded unit."""

import pytest

from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.plan.block_time import block_time
from trainer3d.plan.devices import PRESETS, Device
from trainer3d.plan.kernels import KERNELS, block_ops, depth, waves
from trainer3d.plan.search import evaluate


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_gemm_model_gives_the_measured_rate_at_the_measured_shape(name):
    """stas00/ml-engineering's MAMF table: the best bf16 matmul rate and the shape it came at."""
    k = KERNELS[name]
    m, n, kk = k.mamf_shape
    assert 2 * m * n * kk / k.gemm_s(m, n, kk) == pytest.approx(k.mamf_tflops * 1e12, rel=1e-9)
    assert k.mamf_tflops < k.peak_tflops


def test_gpu_presets_time_their_kernels_at_their_own_memory_bandwidth():
    for name, device in PRESETS.items():
        if device.kernels is not None:
            assert device.kernels.hbm_gbps == pytest.approx(device.memory_gbps), name
            assert device.kernels.peak_tflops == device.peak_tflops["bf16"], name
    assert PRESETS["cpu"].kernels is None  # CPUs: the calibrated matmul rate


def test_wave_and_tile_quantisation_by_hand():
    # 108 tiles of 128 x 128 fill 108 SMs exactly once
    assert waves(128, 128 * 108, 108) == 1.0
    # one more column of tiles: 109 x 128^2 tiles need 2 waves (109 / 216); 128 x 64 tiles,
    # 218 of them, need 3 waves (218 / 324), the best shape
    assert waves(128, 128 * 109, 108) == pytest.approx(218 / 324)
    # an output of 100 rows pads every 128-row tile: 100 / 128 of it does work
    assert waves(100, 128, 1) == pytest.approx(100 / 128)
    assert depth(64) == 0.5 and depth(6400) == pytest.approx(100 / 101)
    a100 = KERNELS["a100"]  # compute-bound: the quantised rate
    m, n, k = 8192, 128 * 109, 8192
    assert a100.gemm_s(m, n, k) == pytest.approx(2 * m * n * k / (a100.rate * waves(m, n, 108) * depth(k)))


def test_a_matrix_vector_product_is_memory_bound():
    h100 = KERNELS["h100"]
    m, n, k = 1, 8192, 8192
    assert h100.gemm_s(m, n, k) == pytest.approx(2 * (m * k + k * n + m * n) / (h100.hbm_gbps * 1e9))


def test_flash_attention_is_the_causal_half_of_the_score_flops_at_its_published_fraction():
    a100 = KERNELS["a100"]
    b, s, heads, d = 2, 4096, 16, 128
    fwd, bwd = a100.attention_s("flash", b, s, heads, d)
    assert fwd == pytest.approx(2 * b * s * s * heads * d / (0.55 * 312e12))
    assert bwd == pytest.approx(2.5 * fwd)  # QK^T recomputed: 5 score-sized matmuls against 2


def test_unfused_attention_computes_every_score_and_moves_them_through_memory():
    a100 = KERNELS["a100"]
    b, s, heads, d = 1, 2048, 24, 96
    fwd, bwd = a100.attention_s("math", b, s, heads, d)
    four_passes = 4 * 2 * b * heads * s * s / (a100.hbm_gbps * 1e9)
    all_scores_at_best = 4 * b * s * s * heads * d / (a100.mamf_tflops * 1e12)
    assert fwd > four_passes + all_scores_at_best
    assert fwd > 2 * a100.attention_s("flash", b, s, heads, d)[0]
    with pytest.raises(ValueError, match="flash or math"):
        a100.attention_s("xformers", b, s, heads, d)


def _cfg(**changes) -> Config:
    cfg = Config()
    cfg.train.dtype = "bf16"
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return validate(cfg)


def test_a_tiny_block_on_a_gpu_is_bound_by_its_launches():
    fwd_ops, bwd_ops = block_ops()
    assert 20 < fwd_ops < bwd_ops  # a block runs tens of operators, backward more
    tiny = _cfg(model__dim=64, model__n_heads=4, model__n_kv_heads=2, model__ffn_dim=128, train__seq_len=64,
                train__micro_batch_size=1, train__global_batch_size=8, train__grad_accum_steps=None)
    block = block_time(tiny, PRESETS["h100-sxm"], 8)
    assert block.forward == pytest.approx(fwd_ops * 10e-6) and block.fwd["launch"] > 0
    assert block.backward == pytest.approx(bwd_ops * 10e-6)
    big = _cfg(model__dim=8192, model__n_heads=64, model__n_kv_heads=8, model__ffn_dim=28672,
               model__max_seq_len=4096, train__seq_len=4096, train__micro_batch_size=1,
               train__global_batch_size=8, train__grad_accum_steps=None)
    assert block_time(big, PRESETS["h100-sxm"], 8).fwd["launch"] == 0.0


def test_zero3_pays_one_collective_latency_per_sharded_unit():
    """Latency only (bandwidth and compute free): every micro-batch gathers the parameters
    forward and backward and reduce-scatters the gradients, each one collective per unit
    (the 8 blocks and the root), each (n - 1) = 1 hop of 1 ms; the step's last unit's gather
    (the next step's first) shows once more."""
    device = Device(name="latency", memory_gib=80, reserved_gib=0, matmul_tflops={"fp32": 1e9, "bf16": 1e9},
                    memory_gbps=1e12, intra_gbps=1e12, inter_gbps=1e12, latency_us=1000.0, source="test")
    cfg = _cfg(model__n_layers=8, parallel__dp=2, parallel__zero_stage=3, train__dtype="fp32",
               train__micro_batch_size=2, train__global_batch_size=16, train__grad_accum_steps=None)
    step = evaluate(cfg, device, 8, "nccl").step
    units, m = 9, cfg.train.grad_accum_steps
    assert step.dp_comm == pytest.approx(m * 3 * units * 1e-3 + 1e-3, rel=1e-3)
