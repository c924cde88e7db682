"""Context parallelism's activation memory, measured: the bytes autograd saves for backward
(``saved_tensors_hooks``, trainer3d/memory/meter.py) on each cp rank of the same sequence,
against one rank holding it whole, and against trainer3d/memory/peak.py's prediction; with
document masking too (data.document_mask: the window's ids, no mask, saved under cp)."""

from types import SimpleNamespace

import pytest
import torch

from tests.support.activation_ranks import layout_config
from tests.support.harness import dims_for, run_ranks
from trainer3d.config.validate import validate
from trainer3d.memory.peak import rank_memory
from trainer3d.data.cp_sharding import shard_sequence


def _config(cp: int, documents: bool = False, **layout):
    cfg = layout_config(**layout)
    cfg.parallel.cp = cp
    cfg.data.document_mask = documents
    return cfg


def _segments(cfg):
    """(accum, micro, seq) segments: documents starting every 5 tokens, a new one each 5th."""
    t = cfg.train
    ids = torch.arange(t.seq_len, dtype=torch.int32) // 5
    return ids.expand(t.grad_accum_steps, t.micro_batch_size, t.seq_len).contiguous()


def _measure(rank: int, world: int, layout: dict) -> int:
    from trainer3d.memory.meter import SavedActivationMeter
    from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer
    from trainer3d.model.documents import segments_of
    from trainer3d.trainer import MicroBatchLoss, Trainer

    cfg = _config(world, **layout)
    dims = dims_for(cp=world)
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    micro_loss = MicroBatchLoss(build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps, optimizer)
    trainer = SimpleNamespace(pipeline=None, chunks=chunks, micro_loss=micro_loss, segments=segments_of(chunks))
    segments = _segments(cfg) if cfg.data.document_mask else None
    t = cfg.train
    rows = torch.randint(0, cfg.model.vocab_size, (t.grad_accum_steps, t.micro_batch_size, t.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    inputs, targets = rows[..., :-1], rows[..., 1:]  # as the loader reads them: views of one tensor (cp = 1)
    if world > 1:  # or this cp rank's two chunks of each, copied out
        inputs, targets = (shard_sequence(x, world, dims.cp_rank) for x in (inputs, targets))
    Trainer.forward_backward(trainer, inputs, targets, segments)  # warm-up
    meter = SavedActivationMeter([p for chunk in chunks for p in chunk.parameters()])
    optimizer.zero_grad()
    with meter:
        Trainer.forward_backward(trainer, inputs, targets, segments)
    assert meter.live_bytes == 0
    return meter.peak_bytes


@pytest.mark.parametrize("layout", [dict(), dict(dtype="bf16", micro=1)], ids=["fp32", "bf16-micro1"])
def test_cp4_saves_a_quarter_of_the_activations(layout):
    whole = run_ranks(_measure, 1, layout, timeout=300)[0]
    shards = run_ranks(_measure, 4, layout, timeout=300)
    for cp, measured in ((1, [whole]), (4, shards)):
        predicted = rank_memory(validate(_config(cp, **layout)), 0).activation_bytes
        assert all(m == predicted for m in measured), (cp, measured, predicted)
    ratios = [m / whole for m in shards]
    print(f"cp=4 / cp=1 saved activations per rank: {whole:,} B -> {shards[0]:,} B ({max(ratios):.3f})")
    assert max(ratios) <= 0.3


@pytest.mark.slow
def test_cp2_document_masked_saves_the_ids_not_a_mask():
    """cp = 2 with document masking saves what cp = 2 without it saves, plus the RoPE tables per
    sequence (not one table for all) and the window's int32 document ids (4 b seq bytes, no
    seq^2 mask): a hand count; and the prediction (trainer3d/memory/peak.py) is the measurement."""
    layout = dict(documents=True)
    plain = run_ranks(_measure, 2, {}, timeout=300)
    masked = run_ranks(_measure, 2, layout, timeout=300)
    cfg = validate(_config(2, **layout))
    t, head_dim = cfg.train, cfg.model.dim // cfg.model.n_heads
    ids = 4 * t.micro_batch_size * t.seq_len
    tables = cfg.model.n_layers * 2 * 4 * (t.seq_len // 2) * head_dim * (t.micro_batch_size - 1)
    predicted = rank_memory(cfg, 0).activation_bytes
    for without, measured in zip(plain, masked):
        assert measured == without + ids + tables, (measured, without, ids, tables)
        assert measured == predicted, (measured, predicted)
