"""Token files, the built-in corpus and the sampler's guarantees (no processes)."""

import math
import tracemalloc

import numpy as np
import pytest
import torch

from trainer3d.data import BYTE_LEVEL, BYTE_VOCAB, EOF_TOKEN, TokenFile, byte_tokens, stdlib_corpus, write_token_file
from trainer3d.data.loader import BatchReader, Prefetcher
from trainer3d.data.sampler import Blend, SampleOrder, Span, split, step_samples
from trainer3d.data.shuffle import derive_key, permute
from trainer3d.data.sources import Part


def make_file(tmp_path, tokens, vocab_size, name="t.bin"):
    return TokenFile.open(write_token_file(tmp_path / name, tokens, vocab_size, BYTE_LEVEL), cache_dir=str(tmp_path))


@pytest.fixture
def token_file(tmp_path):
    return make_file(tmp_path, np.arange(10_000) % 250, 250)


def reader(files, seq, micro, accum, dp=1, dp_rank=0, seed=5, weights=None, spans=None, **kw):
    spans = spans or [Span(0, len(f.tokens), seq) for f in files]
    parts = [Part(f.path, w, s) for f, w, s in zip(files, weights or [1.0] * len(files), spans)]
    order = SampleOrder([s.n_windows for s in spans], [p.weight for p in parts], seed)
    return BatchReader(files, parts, order, micro, accum, dp, dp_rank, **kw)


def test_token_file_roundtrip(token_file):
    h = token_file.header
    assert (h.vocab_size, h.dtype, h.n_tokens, h.max_id, h.tokenizer) == (250, "uint16", 10_000, 249, BYTE_LEVEL)
    assert np.array_equal(np.asarray(token_file.tokens[:300]), np.arange(300) % 250)


def test_truncated_token_file_refused(token_file):
    with open(token_file.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated"):
        TokenFile.open(token_file.path)


def test_byte_tokens():
    assert byte_tokens([b"ab", b"c"]).tolist() == [97, 98, EOF_TOKEN, 99, EOF_TOKEN]


def test_stdlib_corpus_is_cached_once(tmp_path):
    path = stdlib_corpus(str(tmp_path))
    mtime = path.stat().st_mtime_ns
    tf = TokenFile.open(path, verify=False)
    assert tf.vocab_size == BYTE_VOCAB and tf.header.eos_id == EOF_TOKEN and len(tf.tokens) > 1_000_000
    assert stdlib_corpus(str(tmp_path)).stat().st_mtime_ns == mtime


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 40_961])
def test_permutation_is_a_bijection(n):
    image = permute(np.arange(n), n, derive_key(3, 0, 1))
    assert np.array_equal(np.sort(image), np.arange(n))
    if n >= 64:  # a different key is a different order, and the order is not the identity
        assert not np.array_equal(image, permute(np.arange(n), n, derive_key(3, 0, 2)))
        assert not np.array_equal(image, np.arange(n))


def test_sampler_memory_does_not_grow_with_the_corpus():
    """Peak traced bytes to find a step's windows: a 10^3-window corpus and a 10^12 one (which a
    per-epoch permutation table would need 8 TB for) cost the same few KiB."""
    def peak(n_windows):
        order = SampleOrder([n_windows], [1.0], seed=1)
        order(step_samples(0, 64, 0, 64))  # warm-up: numpy's own first-use allocations
        tracemalloc.start()
        for step in (7, 10 ** 6):
            order(step_samples(step, 64, 0, 64))
        used = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return used
    small, huge = peak(10 ** 3), peak(10 ** 12)
    print(f"sampler peak: {small} B for 1e3 windows, {huge} B for 1e12 windows")
    assert huge < 64 * 1024 and huge <= 2 * small + 4096


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batch_is_the_same_whatever_dp(token_file, tmp_path, dp):
    other = make_file(tmp_path, (np.arange(5_000) * 7) % 250, 250, "u.bin")
    for files, weights in (([token_file], None), ([token_file, other], [0.7, 0.3])):
        micro, accum_1 = 2, 8  # global batch 16
        ref = reader(files, 32, micro, accum_1, weights=weights)
        for step in (0, 3, 40):  # 40 * 16 > n_windows: crosses an epoch boundary
            want, _ = ref.batch(step)
            got = torch.cat([reader(files, 32, micro, accum_1 // dp, dp=dp, dp_rank=r, weights=weights).batch(step)[0]
                             .reshape(-1, 32) for r in range(dp)])
            assert torch.equal(got, want.reshape(-1, 32))


def test_a_rank_reads_only_what_it_feeds(token_file):
    both = reader([token_file], 16, 2, 3, seed=1)
    inputs, targets = both.batch(4)
    assert inputs.shape == targets.shape == (3, 2, 16)
    assert torch.equal(inputs[..., 1:], targets[..., :-1])
    assert torch.equal(reader([token_file], 16, 2, 3, seed=1, targets=False).batch(4)[0], inputs)   # first stage
    assert reader([token_file], 16, 2, 3, seed=1, targets=False).batch(4)[1] is None
    assert torch.equal(reader([token_file], 16, 2, 3, seed=1, inputs=False).batch(4)[1], targets)   # last stage
    assert reader([token_file], 16, 2, 3, seed=1, inputs=False, targets=False).batch(4) == (None, None)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_rank_reads_its_chunks(token_file, cp):
    """Each cp rank's inputs and targets are its two chunks of the whole windows (sharding by
    hand: 2 * cp chunks of 32 / (2 * cp) tokens, rank r holding r and 2cp-1-r), whichever
    stage reads them."""
    inputs, targets = reader([token_file], 32, 2, 3, seed=1).batch(4)
    n = 32 // (2 * cp)
    for r in range(cp):
        cols = [*range(r * n, (r + 1) * n), *range((2 * cp - 1 - r) * n, (2 * cp - r) * n)]
        got = reader([token_file], 32, 2, 3, seed=1, cp=cp, cp_rank=r).batch(4)
        assert torch.equal(got[0], inputs[..., cols]) and torch.equal(got[1], targets[..., cols])
        assert torch.equal(reader([token_file], 32, 2, 3, seed=1, cp=cp, cp_rank=r, inputs=False).batch(4)[1],
                           targets[..., cols])
        assert torch.equal(reader([token_file], 32, 2, 3, seed=1, cp=cp, cp_rank=r, targets=False).batch(4)[0],
                           inputs[..., cols])


def test_sampler_is_deterministic_and_resumable():
    a, b = SampleOrder([600], [1.0], seed=9), SampleOrder([600], [1.0], seed=9)
    walked = [a(step_samples(s, 16, 0, 16))[1] for s in range(31)]
    # b jumps straight to step 30 (a resumed run): same windows as a, which read every step before
    assert np.array_equal(walked[30], b(step_samples(30, 16, 0, 16))[1])
    assert not np.array_equal(walked[0], SampleOrder([600], [1.0], seed=10)(step_samples(0, 16, 0, 16))[1])
    epoch = np.concatenate([a(np.arange(600))[1]])
    assert np.array_equal(np.sort(epoch), np.arange(600)), "every window once per epoch"
    assert not np.array_equal(epoch, a(np.arange(600, 1200))[1]), "a new order each epoch"


def test_blend_proportions_over_1000_steps():
    """After every one of 1,000 steps of 16 samples, each source's count is within
    ceil(log2 K) / 2 samples of steps * 16 * weight (the bound sampler.py derives),
    plus the weights' rounding to 2^-20 of their total."""
    weights = [0.5, 0.3, 0.15, 0.05]
    blend, G = Blend(weights), 16
    source, index = blend(np.arange(1000 * G))
    counts = np.zeros(len(weights))
    bound = math.ceil(math.log2(len(weights))) / 2 + 1000 * G * len(weights) / 2 ** 21
    for step in range(1000):
        counts += np.bincount(source[step * G:(step + 1) * G], minlength=len(weights))
        assert np.abs(counts - (step + 1) * G * np.array(weights)).max() <= bound, step
    for k in range(len(weights)):  # each source is consumed in order, none skipped or repeated
        assert np.array_equal(index[source == k], np.arange(counts[k]))
    # a resumed sampler (a new object at step 700) agrees; so does any split of a step over ranks
    assert np.array_equal(Blend(weights)(np.arange(700 * G, 701 * G))[0], source[700 * G:701 * G])


def test_validation_windows_are_disjoint_from_training(tmp_path):
    n = 20_000  # token value = position, so a batch shows which tokens it read
    tf = make_file(tmp_path, np.arange(n), n + 1)
    n_train, n_val = split(n, 0.1)
    train = reader([tf], 32, 4, 2, spans=[Span(0, n_train, 32)], seed=3)
    val = reader([tf], 32, 4, 2, spans=[Span(n_train, n_val, 32)], seed=99)
    steps = train.n_windows // 8 + 2  # an epoch and a bit
    seen_train = torch.cat([torch.cat(train.batch(s)).flatten() for s in range(steps)])
    val_steps = val.n_windows // 8
    seen_val = torch.cat([torch.cat(val.batch(s)).flatten() for s in range(val_steps)])
    assert seen_train.max() < n_train <= seen_val.min()
    assert len(torch.unique(seen_val)) >= val_steps * 8 * 32, "no validation window read twice"


def test_prefetcher_gives_the_readers_batches(token_file):
    r = reader([token_file], 16, 2, 2)
    pre = Prefetcher(r, torch.device("cpu"), last_step=50)
    try:
        for step in [0, 1, 2, 3, 10, 11, 5, 49]:  # in order (read ahead), a jump (a resume), backwards
            got, want = pre.get(step), r.batch(step)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        pre.close()
