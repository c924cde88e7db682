"""The planner's charge for ``optim.name=muon`` (trainer3d/plan/muon_cost.py) against a hand count."""

import dataclasses

import pytest

import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.schema import Config
from trainer3d.plan.devices import PRESETS
from trainer3d.memory.muon_step import muon_step_bytes, ns_shares, parameter_step_bytes, rank_muon_params
from trainer3d.parallel.zero.muon import ns_owners
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
    cfg.optim.muon.layer_wise = False  # every rank orthogonalises every matrix: the gather alone is added
    assert muon_s(cfg, device, 0, 8) > alone


def test_owners_take_the_costliest_first_onto_the_least_loaded_rank():
    """Longest processing time first, by hand: 5 -> rank 0, 3 -> rank 1, 3 -> rank 1 (3 < 5),
    1 -> rank 0 (5 < 6); equal loads go to the lower rank."""
    assert ns_owners([(5,), (3,), (3,), (1,)], 2) == [0, 1, 1, 0]
    assert ns_owners([(1,), (5,), (3,), (3,)], 2) == [0, 0, 1, 1]
    assert ns_owners([(2,), (2,), (2,)], 3) == [0, 1, 2]
    assert ns_owners([(2,)], 4) == [0]


def test_layer_wise_splits_newton_schulz_over_dp():
    """The tiny model's 4 blocks on dp2 ZeRO-1: each rank orthogonalises 2 blocks' matrices
    (half of the 28), charged at 2 blocks' FLOPs plus the results' broadcasts (the volume of the
    look-ahead's gather again); layer_wise=false: every rank all 4 blocks, and the gather."""
    block = 2 * _ns_by_hand(128, 128) + 2 * _ns_by_hand(64, 128) + 3 * _ns_by_hand(128, 384)
    cfg = Config()
    cfg.optim.name = "muon"
    cfg.parallel.dp, cfg.parallel.zero_stage = 2, 1
    shares = ns_shares(cfg, rank_muon_params(cfg, 4))
    assert [len(s) for s in shares] == [14, 14]
    assert [sum(ns_flops(*shape[-2:], 5) for shape, _ in s) for s in shares] == [2 * block, 2 * block]
    device = dataclasses.replace(PRESETS["h100-sxm"], matmul_tflops={"fp32": 1.0, "bf16": 2.0})
    cfg.optim.muon.layer_wise = False
    assert [len(s) for s in ns_shares(cfg, rank_muon_params(cfg, 4))] == [28]
    every = muon_s(cfg, device, 0, 8)
    gather = every - 4 * block / 2e12
    assert gather > 0
    cfg.optim.muon.layer_wise = True
    assert muon_s(cfg, device, 0, 8) == pytest.approx(2 * block / 2e12 + 2 * gather)


def test_layer_wise_step_transient_is_the_largest_matrix_a_rank_orthogonalises():
    """One block of the tiny model on dp4 ZeRO-1: its three 128 x 384 SwiGLU matrices go to
    ranks 0-2, rank 3 gets the two 128 x 128 ones (and more), so its transient is a 128 x 128
    matrix's; the dp group's largest is the 128 x 384's."""
    cfg = Config()
    cfg.optim.name = "muon"
    cfg.parallel.dp, cfg.parallel.zero_stage = 4, 1
    big, small = parameter_step_bytes((128, 384), False, 2), parameter_step_bytes((128, 128), False, 2)
    assert big > small
    assert [muon_step_bytes(cfg, 1, r) for r in range(4)] == [big, big, big, small]
    assert muon_step_bytes(cfg, 1) == big


def _one_a100(optim, *overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.conftest import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("plan", [
            "model=smollm2-1.7b", "cluster.nodes=1", "cluster.gpus_per_node=1", "cluster.gpu=a100-40g",
            "train.global_batch_size=64", "train.seq_len=2048", f"optim={optim}", *overrides]))


def test_muons_smaller_state_changes_the_best_layout():
    """SmolLM2-1.7B on one 40 GB A100 (docs/optimizers.md prints both searches): micro-batches of 4
    fit AdamW's 8 bytes of moments per parameter only with the optimizer offloaded, so AdamW's
    fastest is micro-batches of 2; Muon's 4 bytes of momentum on the blocks' 1.61B matrix
    elements fit micro-batches of 4 on the device, its fastest. No Muon plan is offloaded (it
    refuses offload: micro-batches of 8, over the device, are not retried offloaded)."""
    from trainer3d.plan.devices import device_for
    from trainer3d.plan.search import evaluate, host_link, search

    narrow = ("search.micro_batch_sizes=[2,4,8]", "search.recompute=[false]")
    device = device_for("a100-40g")
    adamw_cfg, muon_cfg = _one_a100("adamw", *narrow), _one_a100("muon", *narrow)
    adamw, muon = search(adamw_cfg, device).plans, search(muon_cfg, device).plans
    best = [(p.cfg.train.micro_batch_size, p.cfg.parallel.offload_optimizer) for p in (adamw[0], muon[0])]
    assert best == [(2, False), (4, False)]
    assert not any(p.cfg.parallel.offload_optimizer for p in muon)
    assert (4, True) in {(p.cfg.train.micro_batch_size, p.cfg.parallel.offload_optimizer) for p in adamw}
    # Muon's layout with AdamW's optimizer, on the device: over the memory by the moments' extra
    # 4 bytes per Muon element (per block: wq, wk, wv, wo 2048 x 2048, w1, w2, w3 2048 x 8192; 24 blocks)
    as_adamw = dataclasses.replace(muon[0].cfg, optim=adamw_cfg.optim)
    plain = evaluate(as_adamw, device, 1, "nccl", link=host_link(adamw_cfg))
    muon_elements = 24 * (4 * 2048 * 2048 + 3 * 2048 * 8192)
    assert plain.memory.states.total - muon[0].memory.states.total == 4 * muon_elements
    assert plain.memory.total > device.usable_bytes(1) >= muon[0].memory.total
