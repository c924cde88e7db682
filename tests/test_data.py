"""Token files, the built-in corpus and the sampler's guarantees."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer3d.data import (BYTE_VOCAB, EOF_TOKEN, DataLoader, TokenFile, WindowSampler, byte_tokens,
                            stdlib_corpus, write_token_file)
from tests.conftest import ROOT


@pytest.fixture
def token_file(tmp_path):
    tokens = np.arange(10_000) % 250
    return TokenFile.open(write_token_file(tmp_path / "t.bin", tokens, vocab_size=250))


def test_token_file_roundtrip(token_file):
    assert token_file.vocab_size == 250 and token_file.tokens.dtype == np.uint16
    assert np.array_equal(np.asarray(token_file.tokens[:300]), np.arange(300) % 250)


def test_truncated_token_file_refused(tmp_path, token_file):
    with open(token_file.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated"):
        TokenFile.open(token_file.path)


def test_byte_tokens():
    assert byte_tokens([b"ab", b"c"]).tolist() == [97, 98, EOF_TOKEN, 99, EOF_TOKEN]


def test_stdlib_corpus_is_cached_once(tmp_path):
    path = stdlib_corpus(str(tmp_path))
    mtime = path.stat().st_mtime_ns
    tf = TokenFile.open(path)
    assert tf.vocab_size == BYTE_VOCAB and len(tf.tokens) > 1_000_000
    assert stdlib_corpus(str(tmp_path)).stat().st_mtime_ns == mtime


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batch_is_the_same_whatever_dp(token_file, dp):
    micro, accum_1 = 2, 8  # global batch 16
    ref = DataLoader(token_file, 32, micro, accum_1, dp=1, dp_rank=0, seed=5)
    for step in (0, 3, 40):  # 40 * 16 > n_windows: crosses an epoch boundary
        want, _ = ref.batch(step)
        got = torch.cat([DataLoader(token_file, 32, micro, accum_1 // dp, dp=dp, dp_rank=r, seed=5).batch(step)[0]
                         .reshape(-1, 32) for r in range(dp)])
        assert torch.equal(got, want.reshape(-1, 32))


def test_targets_are_inputs_shifted(token_file):
    inputs, targets = DataLoader(token_file, 16, 2, 3, dp=1, dp_rank=0, seed=1).batch(0)
    assert inputs.shape == targets.shape == (3, 2, 16)
    assert torch.equal(inputs[..., 1:], targets[..., :-1])


def test_sampler_is_deterministic_and_resumable(token_file):
    a = WindowSampler(len(token_file.tokens), 32, 16, seed=9)
    b = WindowSampler(len(token_file.tokens), 32, 16, seed=9)
    for step in range(30):
        a.windows(step)
    # b jumps straight to step 30 (a resumed run): same windows as a, which read every step before
    assert np.array_equal(a.windows(30), b.windows(30))
    assert not np.array_equal(a.windows(0), WindowSampler(len(token_file.tokens), 32, 16, seed=10).windows(0))
    epoch = np.concatenate([a.windows(s) for s in range(a.n_windows // 16)])
    assert len(set(epoch.tolist())) == len(epoch), "no window repeats within an epoch"


def test_corpus_too_small_for_batch(token_file):
    with pytest.raises(ValueError, match="train.global_batch_size"):
        WindowSampler(len(token_file.tokens), 1000, 64, seed=0)


def test_prepare_data_tool(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello")
    (tmp_path / "texts" / "b.md").write_text("world!")
    out = tmp_path / "corpus.bin"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"), "--out", str(out),
                           str(tmp_path / "texts")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    tf = TokenFile.open(out)
    assert tf.tokens.tolist() == list(b"hello") + [EOF_TOKEN] + list(b"world!") + [EOF_TOKEN]
