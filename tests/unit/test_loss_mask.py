"""The loss mask in one process: the masked loss against torch's cross-entropy (ignore_index,
summed, divided by the normaliser), the mask read at the targets' offsets, the mask file's
checks, and the config's refusal."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.config.validate import ConfigError, validate
from trainer3d.data import BYTE_LEVEL, TokenFile, TokenFileError, write_token_file
from trainer3d.data.loader import BatchReader
from trainer3d.data.loss_mask import IGNORE_INDEX, MaskWriter, mask_path, open_mask
from trainer3d.data.sampler import SampleOrder, Span
from trainer3d.data.sources import Part
from trainer3d.memory.states import planning_dims
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.parallelize import build_loss_fn

MODEL = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=16)


@pytest.mark.parametrize("chunk", [0, 5, 64])
def test_the_masked_loss_is_torchs_sum_over_kept_tokens_over_the_normaliser(chunk):
    cfg = Config(model=copy.deepcopy(MODEL))
    cfg.train.loss_chunk_tokens = chunk
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    ref = copy.deepcopy(model)
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, MODEL.vocab_size, (3, 7), generator=g) for _ in range(2))
    y[torch.rand(y.shape, generator=g) < 0.5] = IGNORE_INDEX
    norm = torch.tensor(13.0)  # any normaliser: the global batch's, not this micro-batch's count
    loss = loss_fn(model(x), y, norm)
    (3 * loss).backward()
    want = F.cross_entropy(ref(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum") / norm
    (3 * want).backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_left_out_targets_label_changes_nothing():
    """Two micro-batches that differ only in the ids of masked-out targets: the same loss and gradient."""
    cfg = Config(model=copy.deepcopy(MODEL))
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    x = torch.randint(0, MODEL.vocab_size, (2, 9))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 9))
    kept = torch.rand(2, 9) < 0.4
    grads = []
    for relabel in (0, 1):
        y = torch.where(kept, tokens, (tokens + relabel) % MODEL.vocab_size).masked_fill(~kept, IGNORE_INDEX)
        model.zero_grad()
        loss = loss_fn(model(x), y, torch.tensor(float(kept.sum())))
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def _token_file_with_mask(tmp_path, n=200):
    rng = np.random.default_rng(0)
    tokens, mask = rng.integers(0, 256, n), (rng.random(n) < 0.3).astype(np.uint8)
    path = write_token_file(tmp_path / "t.bin", tokens, 257, BYTE_LEVEL, eos_id=256)
    writer = MaskWriter(path, "assistant")
    writer.write(mask)
    writer.publish(TokenFile.open(path).header.sha256)
    return path, tokens, mask


@pytest.mark.parametrize("inputs,targets", [(True, True), (False, True)])
def test_the_mask_is_read_at_the_targets_offsets(tmp_path, inputs, targets):
    path, tokens, mask = _token_file_with_mask(tmp_path)
    file = TokenFile.open(path)
    seq = 16
    part = Part(path, 1.0, Span(0, len(tokens), seq))
    order = SampleOrder([part.span.n_windows], [1.0], seed=3)
    reader = BatchReader([file], [part], order, micro_batch_size=2, grad_accum_steps=2, dp=1, dp_rank=0,
                         inputs=inputs, targets=targets, masks=[open_mask(path, file.header, None)])
    got_inputs, got = reader.batch(1)
    _, windows = reader.windows(1)
    for i, w in enumerate(windows.tolist()):  # by hand: window w's targets are tokens w*seq+1 .. w*seq+seq
        want = np.where(mask[w * seq + 1:w * seq + seq + 1] == 1, tokens[w * seq + 1:w * seq + seq + 1], IGNORE_INDEX)
        assert got.reshape(-1, seq)[i].tolist() == want.tolist()
        if inputs:
            assert got_inputs.reshape(-1, seq)[i].tolist() == tokens[w * seq:w * seq + seq].tolist()


def test_a_mask_that_is_missing_damaged_or_of_another_version_is_refused(tmp_path):
    path, tokens, _ = _token_file_with_mask(tmp_path)
    header = TokenFile.open(path).header
    data = bytearray(mask_path(path).read_bytes())
    data[7] ^= 1
    mask_path(path).write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match="does not match its header"):
        open_mask(path, header, cache_dir=str(tmp_path / "cache"))
    write_token_file(path, tokens[::-1].copy(), 257, BYTE_LEVEL, eos_id=256)  # the token file made again
    with pytest.raises(TokenFileError, match="belongs to another version of"):
        open_mask(path, TokenFile.open(path).header, cache_dir=None)
    mask_path(path).unlink()
    with pytest.raises(TokenFileError, match=r"data.loss_mask=true but .*t\.bin has no loss mask .*--chat"):
        open_mask(path, TokenFile.open(path).header, cache_dir=None)


def test_a_loss_mask_on_the_builtin_corpus_is_refused():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", ["data.loss_mask=true", "run_dir=/tmp/x", "launcher.folder=/tmp/x"]))
    with pytest.raises(ConfigError, match="data.loss_mask=true needs token files with a loss mask"):
        validate(cfg)
