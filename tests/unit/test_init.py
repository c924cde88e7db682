"""The layout-independent random init drawn per rank: torch's draw of the whole tensor, sliced
without being held (trainer3d/model/normal_stream.py); start-up cost."""

import math
import random
import sys
from dataclasses import replace

import pytest
import torch

from tests.conftest import ROOT
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.memory.states import planning_dims
from trainer3d.model import normal_stream
from trainer3d.model.init import RandomInit, TPShard, _seed_for, full_init
from trainer3d.model.transformer import output_projection_std
from trainer3d.parallel.parallelize import build_model_chunks

sys.path.insert(0, str(ROOT / "tools" / "bench"))
import init as bench_init  # noqa: E402  (tools/bench/init.py)

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=32)


def torch_draw(name, shape, seed=5):
    """The reference: torch's own draw of the whole tensor from the parameter's generator."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(_seed_for(seed, name)))


@pytest.mark.parametrize("name,shape,dim,tp", [
    ("layers.0.attention.wq.weight", (600, 520), 0, 3),      # rows
    ("layers.0.attention.wo.weight", (520, 600), 1, 4),      # columns
    ("layers.0.feed_forward.w2.weight", (300, 1376), 1, 8),  # 7b's FFN shape at tp=8, scaled down
    ("tok_embeddings.weight", (1001, 70), 0, 8),             # vocabulary 1001 padded to 8 x 126
    ("output.weight", (1001, 70), 0, 3),                     # 1001 = 3 x 334 - 1, size not a multiple of 16
    ("layers.0.attention.wo.weight", (37, 101), 1, 4),       # columns padded, odd width, odd size
    ("output.weight", (5, 300), 0, 4),                       # fewer rows than ranks: empty slices
    ("output.weight", (7, 2), 0, 2),                         # fewer than 16 values: torch's other path
])
def test_every_tp_slice_is_the_slice_of_torchs_full_draw(name, shape, dim, tp, monkeypatch):
    """Each rank's slice, drawn alone, equals the same slice of torch.randn of the whole
    tensor (bit for bit), and the slices of all ranks rebuild it; padding rows are zero."""
    monkeypatch.setattr(normal_stream, "CHUNK", 97)  # many chunks, none aligned to rows or blocks
    std = output_projection_std(CFG) if name.endswith("wo.weight") or name.endswith("w2.weight") else CFG.init_std
    full = torch_draw(name, shape) * std
    assert torch.equal(full_init(name, shape, CFG, seed=5), full)
    init = RandomInit(CFG, seed=5)
    local = -(-shape[dim] // tp)
    pieces = [init(name, shape, TPShard(dim=dim, rank=r, size=tp, full=shape[dim])) for r in range(tp)]
    assert all(p.shape[dim] == local for p in pieces)
    stacked = torch.cat(pieces, dim=dim)
    assert torch.equal(stacked.narrow(dim, 0, shape[dim]), full)
    assert not stacked.narrow(dim, shape[dim], tp * local - shape[dim]).any(), "padding rows are zero"


def test_any_rectangle_of_a_stream_is_torchs_draw(monkeypatch):
    """Random rectangles of random shapes (tails of every length mod 16, reads that start in
    the block the previous one ended in) against torch.randn of the whole shape."""
    monkeypatch.setattr(normal_stream, "CHUNK", 40)
    rng = random.Random(0)
    for trial in range(300):
        rows, cols = rng.randint(1, 30), rng.randint(1, 30)
        r0, c0 = rng.randint(0, rows), rng.randint(0, cols)
        r1, c1 = rng.randint(r0, rows), rng.randint(c0, cols)
        want = torch.randn(rows, cols, generator=torch.Generator().manual_seed(trial))[r0:r1, c0:c1]
        got = normal_stream.normal_rectangle(torch.Generator().manual_seed(trial), (rows, cols), ((r0, r1), (c0, c1)))
        assert torch.equal(got, want), (rows, cols, r0, r1, c0, c1)


def test_norms_are_one_and_projections_scaled():
    assert torch.equal(full_init("layers.1.ffn_norm.weight", (64,), CFG, 0), torch.ones(64))
    assert output_projection_std(CFG) == CFG.init_std / math.sqrt(2 * CFG.n_layers)


def test_a_resumed_run_initialises_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a parameter source was asked for values")

    monkeypatch.setattr("trainer3d.parallel.parallelize.parameter_source", refuse)
    cfg = Config(model=CFG)
    cfg.parallel.tp = 2
    (chunk,) = build_model_chunks(cfg, replace(planning_dims(cfg, 1), device=torch.device("cpu")), initialise=False)
    assert all(not p.any() for p in chunk.parameters())  # the padded vocabulary's tail included


@pytest.mark.slow
def test_7b_rank_start_up_costs_about_its_own_shard():
    """Rank (pp 0, tp 0) of 7b at tp=8 pp=4, built for real in bf16 in a child process: its
    peak resident set stays near its own shard's bytes (drawing each full matrix and slicing
    it needed 2.5 x: the full fp32 embedding alone is 1.2 x) and its CPU time near that of
    drawing the shard's normal values once (drawing every full matrix: 21 x). The stream
    draws 3.0 x the shard's values here: the row-split matrices stop at the end of the
    rank's rows, but wo and w2 are split by columns, so each row is drawn up to the end of
    the slice, i.e. whole (torch's generator cannot jump ahead); measured 4.7-5.4 x."""
    figures = bench_init.measure("7b", tp=8, pp=4, dtype="bf16")
    # the embedding's slice and 8 blocks' tp slices (wq wk wv wo, w1 w3 w2, two norms)
    assert figures["numel"] == 32000 * 4096 // 8 + 8 * (4 * 4096 * 512 + 3 * 4096 * 1376 + 2 * 4096)
    assert figures["peak_above_start"] < 1.6 * figures["shard_bytes"], figures
    assert figures["build_cpu_s"] < 8 * figures["reference_cpu_s"], figures
