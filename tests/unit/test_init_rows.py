"""A parameter source asked for ``rows`` of a rank's tp slice (ZeRO-2/3's dp shard of it,
parallel/zero/fsdp.py ``fill_shards``) gives exactly those rows: of torch's own draw of the
whole tensor (``RandomInit``), of the tensor in the safetensors file (``HFSource``), with
the tp slice's padding rows zero, and the shards of every dp rank rebuild the tp slice."""

import pytest
import torch
from safetensors.torch import save_file

from trainer3d.config.schema import ModelConfig
from trainer3d.hf.mapping import to_hf
from trainer3d.hf.source import HFSource
from trainer3d.model import normal_stream
from trainer3d.model.init import RandomInit, TPShard, _seed_for
from trainer3d.model.transformer import output_projection_std

CFG = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=32)
CASES = [  # name, full shape, tp dim or None, tp, tp rank, dp
    ("tok_embeddings.weight", (101, 64), 0, 2, 1, 4),       # 51 rows on tp rank 1: 50 real, 1 padding
    ("output.weight", (101, 64), 0, 4, 3, 3),               # 26 rows: 23 real, 3 padding over 3 dp ranks
    ("layers.0.attention.wo.weight", (64, 64), 1, 2, 0, 4),  # a column slice, its rows split over dp
    ("layers.0.feed_forward.w1.weight", (96, 64), None, 1, 0, 5),  # whole, 96 rows over 5: 20 x 4 + 16
    ("layers.0.attention_norm.weight", (64,), None, 1, 0, 3),
]


def _dp_rows(rows, dp, rank):
    per = -(-rows // dp)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def _tp_slice(full, dim, tp, rank):
    """The reference: torch's narrow of the whole tensor, then the padding rows zero."""
    if dim is None:
        return full
    local = -(-full.shape[dim] // tp)
    start = min(rank * local, full.shape[dim])
    part = full.narrow(dim, start, min(local, full.shape[dim] - start))
    pad = list(part.shape)
    pad[dim] = local - part.shape[dim]
    return torch.cat([part, part.new_zeros(pad)], dim=dim)


def _check(source, name, shape, dim, tp, tp_rank, dp, expected):
    shard = None if dim is None else TPShard(dim=dim, rank=tp_rank, size=tp, full=shape[dim])
    assert torch.equal(source(name, shape, shard), expected)
    pieces = []
    for r in range(dp):
        lo, hi = _dp_rows(expected.shape[0], dp, r)
        got = source(name, shape, shard, (lo, hi))
        assert torch.equal(got, expected[lo:hi]), (name, r, lo, hi)
        pieces.append(got)
    assert torch.equal(torch.cat(pieces), expected)


@pytest.mark.parametrize("name,shape,dim,tp,tp_rank,dp", CASES)
def test_random_init_rows_are_rows_of_torchs_full_draw(name, shape, dim, tp, tp_rank, dp, monkeypatch):
    monkeypatch.setattr(normal_stream, "CHUNK", 97)  # many chunks, none aligned to rows or blocks
    if name.endswith("norm.weight"):
        full = torch.ones(shape)
    else:
        std = output_projection_std(CFG) if name.endswith(("wo.weight", "w2.weight")) else CFG.init_std
        full = torch.randn(shape, generator=torch.Generator().manual_seed(_seed_for(5, name))) * std
    _check(RandomInit(CFG, 5), name, shape, dim, tp, tp_rank, dp, _tp_slice(full, dim, tp, tp_rank))


@pytest.mark.parametrize("name,shape,dim,tp,tp_rank,dp", CASES)
def test_hf_source_reads_only_the_rows(tmp_path, name, shape, dim, tp, tp_rank, dp):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    save_file({to_hf(name): full}, str(tmp_path / "model.safetensors"))
    _check(HFSource(tmp_path, CFG), name, shape, dim, tp, tp_rank, dp, _tp_slice(full, dim, tp, tp_rank))
