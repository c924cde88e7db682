"""An MoE block's saved activations term by term against ``saved_tensors_hooks`` (the meter),
its parameter shapes against the model built on meta, and the expert-parallel terms against
hand counts (trainer3d/memory/moe.py)."""

import dataclasses
from math import prod

import pytest
import torch

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.memory.meter import SavedActivationMeter
from trainer3d.memory.moe import (MoESizes, all_to_all_bytes, layout_model_state_bytes, moe_ffn_terms,
                                  stage_expert_mask)
from trainer3d.memory.states import engine_model_state_bytes, format_bytes, stage_parameter_shapes
from trainer3d.model.moe import MoE
from trainer3d.model.transformer import Transformer

DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}


def _cfg(**moe) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(dim=16, ffn_dim=24, n_layers=5, n_heads=2, n_kv_heads=2, vocab_size=32)
    cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe.expert_ffn_dim = 4, 2, 8
    for key, value in moe.items():
        setattr(cfg.model.moe, key, value)
    return cfg


def _saved_by_block(cfg: Config, dtype: torch.dtype, tokens: int) -> int:
    """Peak saved bytes of one MoE block's forward on ``tokens`` tokens, its input's storage
    (the norm's output: the dense block's ffn_input term) left out."""
    torch.manual_seed(0)
    block = MoE(cfg.model).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(tokens, 1, cfg.model.dim, dtype=dtype, requires_grad=True) * 1  # not a leaf, as in a model
    meter = SavedActivationMeter([*block.parameters(), x])
    with meter:
        block(x).float().sum().backward()
        return meter.peak_bytes


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("moe", [dict(), dict(router="sigmoid_topk", z_loss_coef=0.01),
                                 dict(num_shared_experts=2, balance="none"), dict(top_k=1, z_loss_coef=0.1)],
                         ids=["softmax", "sigmoid-z", "shared-no-aux", "top1-z"])
def test_moe_block_saves_what_the_terms_charge(moe, dtype):
    cfg = _cfg(**moe)
    torch_dtype, p = DTYPES[dtype]
    tokens = 12
    want = sum(moe_ffn_terms(MoESizes.of(cfg), tokens, p, cfg.model.dim).values())
    assert _saved_by_block(cfg, torch_dtype, tokens) == want


def test_capacity_charges_the_bound_and_meets_it_without_drops():
    """With a capacity the kept slots depend on the routing: the charge is E x capacity (or
    T k, the smaller); a capacity no expert reaches drops nothing, and the charge is exact."""
    tokens = 12
    loose = _cfg(capacity_factor=2.0)  # capacity 12 per expert: never reached by 12 tokens
    assert MoESizes.of(loose).slots(tokens) == tokens * 2
    assert _saved_by_block(loose, torch.float32, tokens) == sum(
        moe_ffn_terms(MoESizes.of(loose), tokens, 4, 16).values())
    tight = _cfg(capacity_factor=0.5)  # capacity ceil(0.5 * 12 * 2 / 4) = 3 per expert: at most 12 slots
    assert MoESizes.of(tight).slots(tokens) == 4 * 3
    assert _saved_by_block(tight, torch.float32, tokens) <= sum(
        moe_ffn_terms(MoESizes.of(tight), tokens, 4, 16).values())


def test_stage_shapes_are_the_models_with_dense_and_moe_blocks_mixed():
    cfg = _cfg(first_dense_layers=1, every=2, num_shared_experts=1)  # blocks 1 and 3 MoE
    with torch.device("meta"):
        real = [tuple(p.shape) for p in Transformer(cfg.model).parameters()]
        names = [n for n, _ in Transformer(cfg.model).named_parameters()]
    assert stage_parameter_shapes(cfg, 0) == real
    assert stage_expert_mask(cfg, 0) == [".experts." in n for n in names]
    assert sum(stage_expert_mask(cfg, 0)) == 2 * 3  # w1, w3, w2 of two MoE blocks


def test_expert_parallel_states_split_the_experts_over_ep_and_their_shards_over_dp_cp_over_ep():
    """ep=2 on dp=4 ZeRO-1 fp32, one bucket each, sizes divisible: the non-expert parameters
    P_d as on dp4 (4 + 4 + 8/4 bytes each), the rank's half of the experts P_e / 2 with Adam
    sharded over dp x cp / ep = 2 ranks (4 + 4 + 8/2 bytes each), two step counters."""
    dense, experts = [(64, 32), (32,)], [(4, 32, 16), (4, 16, 32)]
    shapes, mask = [*dense, *experts], [False, False, True, True]
    got = layout_model_state_bytes(shapes, mask, ep=2, shards=4, stage=1, dtype="fp32", bucket_numel=10 ** 6)
    p_dense, p_experts = sum(prod(s) for s in dense), sum(prod(s) for s in experts)
    assert got.total == (4 + 4 + 8 / 4) * p_dense + (4 + 4 + 8 / 2) * p_experts / 2 + 2 * 4
    # ep = 1: every parameter in the one flat buffer over dp x cp, as the engine runs today
    one = layout_model_state_bytes(shapes, mask, ep=1, shards=4, stage=1, dtype="fp32", bucket_numel=10 ** 6)
    assert one == engine_model_state_bytes(shapes, 4, 1, "fp32", 10 ** 6)


def test_all_to_all_and_received_slots_by_hand():
    m = MoESizes(experts=8, top_k=2, ffn=8, shared_ffn=0, sigmoid=False, aux_loss=True, z_loss=False, ep=4)
    tokens, p, h = 100, 2, 64
    # each of the T k slots leaves for another rank with probability (ep - 1) / ep under balance
    assert all_to_all_bytes(m, tokens, p, h) == 200 * p * h * 3 // 4
    assert all_to_all_bytes(dataclasses.replace(m, ep=1), tokens, p, h) == 0
    assert m.received_slots(tokens) == 200  # balanced: as many as it sends
    # worst case: all 4 ranks' tokens to this rank's 2 experts, both of a token's slots here
    assert m.received_slots(tokens, worst=True) == 4 * 100 * 2
    wide = dataclasses.replace(m, top_k=4)  # at most E / ep = 2 of a token's 4 slots can land on one rank
    assert wide.received_slots(tokens, worst=True) == 4 * 100 * 2
    terms, worst = moe_ffn_terms(m, tokens, p, h), moe_ffn_terms(m, tokens, p, h, worst=True)
    assert worst["dispatched"] - terms["dispatched"] == (800 - 200) * p * h
    assert terms["experts"] == 2 * p * 200 * 8 + 8 * 2  # w1 x, w3 x; counts of the 2 local experts


def test_dry_run_prints_the_dropless_worst_case_beside_the_balanced_charge_under_ep():
    """tiny-moe (4 blocks, 4 experts, top-2, dim 64, expert width 128), dp=2, fp32, a micro-batch
    of 2 x 32 tokens, ep = 2 set after validate() (which refuses ep until it is built): the
    balanced charge is T k = 128 slots a block; the worst case 2 ranks x 64 tokens x min(2, 4/2)
    = 256, each slot p (h + 2 f) bytes more in `dispatched` and `experts`."""
    from tests.unit.test_presets import _training
    from trainer3d.config.validate import validate
    from trainer3d.memory.dry_run import moe_lines
    from trainer3d.memory.peak import rank_memory

    cfg = validate(_training(["model=tiny-moe", "parallel=dp2", "train.dtype=fp32", "train.micro_batch_size=2",
                              "train.seq_len=32", "train.global_batch_size=8"]))
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=2))
    mem = rank_memory(cfg, 0)
    extra = 4 * (256 - 128) * 4 * (64 + 2 * 128)
    lines = moe_lines(cfg, mem)
    assert "balanced expectation" in lines[0] and "(2 per rank, ep=2)" in lines[0]
    assert lines[1].endswith(f"+{format_bytes(extra)} on pp rank 0"), lines
    assert mem.activations["layers.moe.dispatched"] == 4 * 128 * 4 * 64  # the balanced charge
