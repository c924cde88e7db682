"""The planner's charge for ``optim.name=muon`` (trainer3d/plan/muon_cost.py) against a hand count."""

import dataclasses

import pytest

from trainer3d.config.schema import Config
from trainer3d.plan.devices import PRESETS
from trainer3d.plan.muon_cost import muon_s, ns_flops


def _ns_by_hand(m, n, steps=5):
    """m <= n: X X^T is m x n by n x m (2 m^2 n), A A is m^3 twice over, the product with X 2 m^2 n."""
    return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def test_newton_schulz_flops_of_the_tiny_model():
    """tiny (dim 128, 4 heads of 32 in 2 kv groups, ffn 384, 4 layers): per block wq, wo 128x128,
    wk, wv 64x128, w1, w3 384x128, w2 128x384."""
    block = 2 * _ns_by_hand(128, 128) + 2 * _ns_by_hand(64, 128) + 3 * _ns_by_hand(128, 384)
    assert block == 592_445_440
    assert ns_flops(384, 128, 5) == ns_flops(128, 384, 5) == _ns_by_hand(128, 384)
    cfg = Config()
    cfg.optim.name = "muon"
    device = dataclasses.replace(PRESETS["h100-sxm"], matmul_tflops={"fp32": 1.0, "bf16": 2.0})
    assert muon_s(cfg, device, 0, 8) == pytest.approx(4 * block / 2e12)  # ns_dtype bf16, one rank, no gather
    cfg.optim.muon.ns_dtype = "fp32"
    assert muon_s(cfg, device, 0, 8) == pytest.approx(4 * block / 1e12)
    cfg.optim.name = "adamw"
    assert muon_s(cfg, device, 0, 8) == 0.0


def test_gathers_are_charged_under_tp_and_zero1():
    cfg = Config()
    cfg.optim.name = "muon"
    device = PRESETS["h100-sxm"]
    alone = muon_s(cfg, device, 0, 8)
    cfg.parallel.tp = 2
    assert muon_s(cfg, device, 0, 8) > alone
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.zero_stage = 1, 2, 1
    assert muon_s(cfg, device, 0, 8) > alone
