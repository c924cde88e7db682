"""Evaluation's pieces on one process: the summed loss over counted targets (parallel/tensor/loss_sum.py)
against torch's own cross-entropy with ``ignore_index``, on whole logits and through the head
chunk by chunk; the validation reader's padding (data/loader.py) marks exactly the samples past
the set and leaves every input as read. The layouts: tests/multirank/test_eval_partial.py."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_data_checks import token_file
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.data.loader import PAD_TARGET, BatchReader
from trainer3d.data.sampler import SampleOrder, Span
from trainer3d.data.sources import Part
from trainer3d.data.tokenfile import TokenFile
from trainer3d.memory.states import planning_dims
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.parallelize import build_eval_loss_fn, build_loss_fn

MODEL = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=16)


@pytest.mark.parametrize("chunk", [0, 5, 64])  # 0: the model returns whole logits
def test_the_sum_counts_only_real_targets(chunk):
    cfg = Config(model=copy.deepcopy(MODEL))
    cfg.train.loss_chunk_tokens = chunk
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    plain = copy.deepcopy(model)
    build_loss_fn(cfg, planning_dims(cfg, 0), [model])  # sets where the head runs, as the trainer does
    sum_fn = build_eval_loss_fn(cfg, planning_dims(cfg, 0), [model])
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, MODEL.vocab_size, (3, 7), generator=g) for _ in range(2))
    y[2] = PAD_TARGET  # a padding window
    y[1, 4:] = PAD_TARGET  # and tokens of another
    with torch.no_grad():
        got = sum_fn(model(x), y)
        want = F.cross_entropy(plain(x).double().flatten(0, 1), y.flatten(), ignore_index=PAD_TARGET,
                               reduction="sum")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_padding_marks_the_targets_past_the_set_and_nothing_else(tmp_path):
    seq, n_windows = 8, 11
    path = token_file(tmp_path, "v.bin", seq * n_windows + 1, ids=np.arange(seq * n_windows + 1) % 200)
    opened = TokenFile.open(path, cache_dir=str(tmp_path / "cache"), eos_id=None, vocab_size=257)
    part = Part(path, 1.0, Span(0, seq * n_windows + 1, seq))
    order = SampleOrder([n_windows], [1.0], seed=3)
    # global batch 8 = micro 2 x 2 micro-batches x dp 2; batch 1 holds samples 8..15, 11.. are padding
    for dp_rank, padded in ((0, [[False, False], [False, True]]), (1, [[True, True], [True, True]])):
        reader = BatchReader([opened], [part], order, 2, 2, dp=2, dp_rank=dp_rank)
        inputs, targets = reader.batch(1, counted=n_windows)
        plain_inputs, plain_targets = reader.batch(1)
        assert torch.equal(inputs, plain_inputs) and inputs.min() >= 0
        marked = (targets == PAD_TARGET).all(dim=-1)
        assert marked.tolist() == padded
        assert torch.equal(targets[~marked], plain_targets[~marked]) and (targets[~marked] >= 0).all()
