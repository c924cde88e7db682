"""The layout-independent random init drawn per rank: slices, statistics, start-up cost."""

import math
import sys
from dataclasses import replace

import pytest
import torch

from tests.conftest import ROOT
from trainer3d.config import Config, ModelConfig
from trainer3d.memory import planning_dims
from trainer3d.model.init import TILE, RandomInit, TPShard, full_init
from trainer3d.model.transformer import output_projection_std
from trainer3d.parallel import build_model_chunks

sys.path.insert(0, str(ROOT / "tools"))
import bench_init  # noqa: E402

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=32)


@pytest.mark.parametrize("name,shape,dim,tp", [
    ("layers.0.attention.wq.weight", (600, 520), 0, 3),      # rows, splits across tile edges
    ("layers.0.attention.wo.weight", (520, 600), 1, 4),      # columns
    ("layers.0.feed_forward.w2.weight", (300, 1376), 1, 8),  # 7b's FFN shape at tp=8, scaled down
    ("tok_embeddings.weight", (1001, 70), 0, 8),             # vocabulary 1001 padded to 8 x 126
    ("output.weight", (5, 300), 0, 4),                       # fewer rows than ranks: empty slices
])
def test_every_tp_slice_is_the_slice_of_the_full_tensor(name, shape, dim, tp):
    full = full_init(name, shape, CFG, seed=5)
    init = RandomInit(CFG, seed=5)
    local = -(-shape[dim] // tp)
    pieces = [init(name, shape, TPShard(dim=dim, rank=r, size=tp, full=shape[dim])) for r in range(tp)]
    assert all(p.shape[dim] == local for p in pieces)
    stacked = torch.cat(pieces, dim=dim)
    assert torch.equal(stacked.narrow(dim, 0, shape[dim]), full)
    assert not stacked.narrow(dim, shape[dim], tp * local - shape[dim]).any(), "padding rows are zero"


def test_statistics_are_those_of_the_init():
    """Normal with init_std (output projections: init_std / sqrt(2 n_layers)), norms one,
    and tiles independent of each other (not one seed repeated)."""
    shape = (4 * TILE, 4 * TILE)  # 16 tiles, 1M values: the std is known to ~0.1%
    for name, std in (("layers.1.attention.wq.weight", CFG.init_std),
                      ("layers.1.feed_forward.w2.weight", CFG.init_std / math.sqrt(2 * CFG.n_layers))):
        values = full_init(name, shape, CFG, seed=0).double()
        assert abs(values.mean().item()) < 5 * std / 1024
        assert abs(values.std().item() / std - 1) < 5e-3, name
        fourth = ((values / std) ** 4).mean().item()
        assert abs(fourth - 3) < 0.05, "kurtosis of a normal"
    assert output_projection_std(CFG) == CFG.init_std / math.sqrt(2 * CFG.n_layers)
    tiles = full_init("layers.1.attention.wq.weight", shape, CFG, seed=0).unfold(0, TILE, TILE).unfold(1, TILE, TILE)
    flat = tiles.reshape(16, -1)
    corr = torch.corrcoef(flat)
    assert (corr - torch.eye(16)).abs().max() < 0.03
    assert torch.equal(full_init("layers.1.ffn_norm.weight", (64,), CFG, 0), torch.ones(64))


def test_a_resumed_run_initialises_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a parameter source was asked for values")

    monkeypatch.setattr("trainer3d.parallel.parameter_source", refuse)
    cfg = Config(model=CFG)
    cfg.parallel.tp = 2
    (chunk,) = build_model_chunks(cfg, replace(planning_dims(cfg, 1), device=torch.device("cpu")), initialise=False)
    assert all(not p.any() for p in chunk.parameters())  # the padded vocabulary's tail included


def test_7b_rank_start_up_costs_about_its_own_shard():
    """Rank (pp 0, tp 0) of 7b at tp=8 pp=4, built for real in bf16 in a child process: its
    peak resident set stays near its own shard's bytes (drawing each full matrix and slicing
    it needed 2.5 x: the full fp32 embedding alone is 1.2 x) and its CPU time near that of
    drawing the shard's normal values once (drawing every full matrix: 20 x)."""
    figures = bench_init.measure("7b", tp=8, pp=4, dtype="bf16")
    # the embedding's slice and 8 blocks' tp slices (wq wk wv wo, w1 w3 w2, two norms)
    assert figures["numel"] == 32000 * 4096 // 8 + 8 * (4 * 4096 * 512 + 3 * 4096 * 1376 + 2 * 4096)
    assert figures["peak_above_start"] < 1.6 * figures["shard_bytes"], figures
    assert figures["build_cpu_s"] < 6 * figures["reference_cpu_s"], figures
