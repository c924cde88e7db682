"""Document masking in one process: the model's masked loss against each document run alone,
and the segments the loader gives a window (from the index, or end-of-document ids)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.tolerance import assert_close_to_scale
from trainer3d.config.schema import ModelConfig
from trainer3d.data.segments import window_segments
from trainer3d.model.documents import Segments, apply_document_mask, masked_sdpa
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=64)


def build(seed=0):
    model = Transformer(CFG)
    init_parameters(model, CFG, seed)
    return model


def segments_of_lengths(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])


def test_masked_loss_is_the_sum_of_each_document_run_alone():
    """Two packed windows of documents (lengths 1 to a whole window): the masked model's summed
    token losses and its input gradients equal those of each document run alone through the
    unmasked model (positions from 0), a reference that shares no code with the mask."""
    torch.manual_seed(0)
    layouts = [[5, 1, 9, 3, 14], [32]]
    tokens = torch.randint(0, CFG.vocab_size, (2, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    masked, plain = build(), build()
    segments = apply_document_mask([masked])
    segments.set(torch.stack([segments_of_lengths(lengths) for lengths in layouts]))
    logits = masked(inputs)
    total = F.cross_entropy(logits.reshape(-1, CFG.vocab_size).float(), targets.reshape(-1), reduction="sum")
    total.backward()
    reference = torch.zeros(())
    for row, lengths in enumerate(layouts):
        at = 0
        for n in lengths:
            out = plain(inputs[row:row + 1, at:at + n])
            reference = reference + F.cross_entropy(out.reshape(-1, CFG.vocab_size).float(),
                                                    targets[row, at:at + n], reduction="sum")
            at += n
    reference.backward()
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=0)
    for (name, a), (_, b) in zip(masked.named_parameters(), plain.named_parameters()):
        assert_close_to_scale(a.grad, b.grad, msg=name)


def test_one_document_per_window_is_plain_causal_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    segments = Segments()
    segments.set(torch.zeros(2, 16, dtype=torch.int32))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(masked_sdpa(q, k, v, segments), want)


def test_positions_restart_at_each_document():
    segments = Segments()
    segments.set(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]]))
    assert segments.positions(torch.device("cpu")).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]]


def test_a_deep_copied_model_reads_its_own_segments():
    """An interleaved rank's chunks are deep copies of the model (parallel/pipeline/stages.py):
    each copy's blocks must read the copy's segments, not the original's (a bound method kept
    by the compile boundary would still read the original's)."""
    original = build()
    apply_document_mask([original])
    clone = copy.deepcopy(original)
    original.document_segments.set(segments_of_lengths([4, 4]).unsqueeze(0))
    clone.document_segments.set(segments_of_lengths([2, 6]).unsqueeze(0))
    core = clone.layers["0"].attention.core
    assert core.positions(8, torch.device("cpu")).tolist() == [[0, 1, 0, 1, 2, 3, 4, 5]]


def test_the_mask_is_one_tensor_saved_once_for_every_block():
    """SDPA keeps the additive mask it is given by reference: a micro-batch saves batch x seq^2
    x itemsize bytes of it, one storage whatever the number of blocks (memory/activations.py)."""
    model = build()
    segments = apply_document_mask([model])
    segments.set(torch.zeros(2, 16, dtype=torch.int32))
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(torch.randint(0, CFG.vocab_size, (2, 16)))
    masks = {t.untyped_storage().data_ptr() for t in seen if t.shape == (2, 1, 16, 16)}
    assert len(masks) == 1


@pytest.mark.parametrize("start", [0, 3, 7])
def test_segments_from_the_index_equal_those_from_end_of_document_ids(start):
    eos = 9
    lengths = [3, 1, 5, 2, 6]
    tokens = np.concatenate([np.r_[np.arange(1, n), eos] for n in lengths])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    from_index = window_segments(starts, tokens, start, 8, eos)
    from_eos = window_segments(None, tokens, start, 8, eos)
    assert from_index.tolist() == from_eos.tolist()
    assert from_index[0] == 0


@pytest.mark.parametrize("batch,seq", [(1, 16), (3, 24)])
def test_saved_bytes_with_documents_are_the_accounting_s(batch, seq):
    """The bytes autograd saves for one micro-batch through the model (SavedActivationMeter),
    with and without document masking: the difference is the mask's b s^2 p once and the
    per-token RoPE tables' 8 (b - 1) s head_dim per block, counted by hand here and by
    memory/activations.py's terms."""
    from trainer3d.memory.activations import Sizes, chunk_terms
    from trainer3d.memory.meter import SavedActivationMeter

    def saved(documents):
        model = build()
        if documents:
            segments = apply_document_mask([model])
            segments.set(torch.zeros(batch, seq, dtype=torch.int32))
        tokens = torch.randint(0, CFG.vocab_size, (batch, seq))
        meter = SavedActivationMeter(list(model.parameters()))
        with meter:
            out = model(tokens)
        out.sum().backward()
        return meter.peak_bytes

    head_dim = CFG.dim // CFG.n_heads
    by_hand = 4 * batch * seq * seq + CFG.n_layers * 8 * (batch - 1) * seq * head_dim
    assert saved(True) - saved(False) == by_hand
    z = Sizes(b=batch, s=seq, h=CFG.dim, heads=CFG.n_heads, kv_heads=CFG.n_kv_heads, head_dim=head_dim,
              ffn=CFG.ffn_dim, vocab=CFG.vocab_size, t=1, sp=False, p=4)
    terms = [sum(chunk_terms(Sizes(**{**z.__dict__, "documents": d}), CFG.n_layers, True, True, False).values())
             for d in (False, True)]
    assert terms[1] - terms[0] == by_hand


def test_the_planner_charges_no_dense_mask_on_gpus_at_128k():
    """At seq 128k (one sequence of a micro-batch, bf16) a dense mask would be 2 x 2^34 bytes =
    32 GiB; on CUDA the plan charges FlexAttention's block mask, 16 x 1024 x 1025 bytes by hand
    (4 int32 tensors of block counts and indices, both directions), and the per-token RoPE
    tables cost nothing more at micro-batch 1. On CPU the same config charges the dense mask."""
    from tests.unit.test_validate import make
    from trainer3d.memory.peak import rank_memory

    seq = 131072
    common = ["model=llama3.1-8b", f"train.seq_len={seq}", "train.micro_batch_size=1", "train.global_batch_size=1",
              "train.dtype=bf16", "parallel.tp=8", "parallel.dp=1"]
    plain, masked = (make([*common, *extra]) for extra in ([], ["data.document_mask=true"]))
    for cuda, mask in ((True, 16 * 1024 * 1025), (False, 2 * seq * seq)):
        a, b = (rank_memory(c, 0, cuda=cuda).activations for c in (plain, masked))
        assert b["document_mask"] == mask
        assert sum(b.values()) - sum(a.values()) == mask


def test_the_planner_charges_ids_not_a_mask_under_cp_at_128k():
    """cp 8 at seq 128k on CPU ranks: no dense mask (it would be 2 x 2^34 bytes), the window's
    int32 ids, 4 x 131072 bytes, saved; RoPE tables per sequence cost nothing more at micro-batch
    1; and one chunk pair's tile as a transient: 1 x 1024 x 8192 bytes of mask plus four fp32
    score tensors of 4 heads (32 heads / tp 8), by hand."""
    from tests.unit.test_validate import make
    from trainer3d.memory.peak import rank_memory

    seq = 131072
    common = ["model=llama3.1-8b", f"train.seq_len={seq}", "train.micro_batch_size=1", "train.global_batch_size=1",
              "train.dtype=bf16", "parallel.tp=8", "parallel.cp=8", "parallel.dp=1", "train.device=cpu"]
    plain, masked = (rank_memory(make([*common, *extra]), 0) for extra in ([], ["data.document_mask=true"]))
    assert "document_mask" not in masked.activations
    assert masked.activations["document_ids"] == 4 * seq
    assert masked.activation_bytes - plain.activation_bytes == 4 * seq
    chunk = seq // 8 // 2
    assert masked.transients["cp_document_pair"] == 1024 * chunk * (1 + 4 * 4 * 4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_block_mask_attends_as_the_dense_mask():
    """The CUDA path's block mask, run through FlexAttention's eager reference on CPU (block 128:
    documents inside a block, across blocks, and blocks no document spans), equals the CPU path."""
    from trainer3d.model.documents import flex_document_attention

    torch.manual_seed(2)
    seq = 384
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    segments = Segments()
    segments.set(torch.stack([segments_of_lengths([3, 200, 1, 60, 120]), segments_of_lengths([seq])]))
    torch.testing.assert_close(flex_document_attention(q, k, v, segments, compiled=False),
                               masked_sdpa(q, k, v, segments), rtol=1e-5, atol=1e-5)
