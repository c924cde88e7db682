"""A V schedule's tied embedding (parallel/tied.py ``share_embedding``): pp rank 0 holds the first
and the last stage, whose embedding and head become one Parameter. One process, no pipeline:
the two stages run each micro-batch as the zero-bubble schedules do (the last stage's input
step and weight step, then the first stage's whole backward), and the one gradient must equal
the one-process tied model's (the reference), its ZeRO bucket hook counting both stages'
accumulations (2 per micro-batch) so that it launches once, after the last of them."""

import copy

import torch
from torch.distributed.pipelining._backward import stage_backward_input

from trainer3d.config.schema import ModelConfig
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.pipeline.stages import keep_stage, stage_layer_ranges
from trainer3d.parallel.pipeline.weight_grad import backward_weight
from trainer3d.parallel.tied import share_embedding
from trainer3d.parallel.zero.buckets import FlatBuffers, GradReducer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16,
                  tie_embeddings=True)
MICRO, SEQ, BATCH = 3, 8, 2


def _model() -> Transformer:
    model = Transformer(CFG)
    init_parameters(model, CFG, seed=0)
    return model


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen),
             torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)) for _ in range(MICRO)]


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))


def test_v_rank_shares_one_embedding_and_its_bucket_waits_for_both_stages():
    ranges = stage_layer_ranges(CFG.n_layers, 2)
    first, last = (keep_stage(copy.deepcopy(_model()), s, ranges) for s in (0, 1))
    assert last.output.weight is last.tok_embeddings.weight is not first.tok_embeddings.weight
    share_embedding([first, last])
    assert last.output.weight is first.tok_embeddings.weight

    # held once, as parallel/zero/flat.py lays the rank's parameters out
    uses = {}
    for p in [*first.parameters(), *last.parameters()]:
        uses[p] = uses.get(p, 0) + 1
    buffers = FlatBuffers(list(uses), bucket_numel=2048, pad_multiple=1, dtype=torch.float32)
    reducer = GradReducer(buffers, group=None, dp=1, dp_rank=0, micro_batches=MICRO, mode="all_reduce",
                          uses=[uses[p] for p in buffers.params])
    embedding = next(i for i, p in enumerate(buffers.params) if p is first.tok_embeddings.weight)
    bucket = buffers.bucket_of[first.tok_embeddings.weight]
    for i, (tokens, targets) in enumerate(_batches()):
        hidden = first(tokens)
        received = hidden.detach().requires_grad_()
        loss = _loss(last(received), targets) / MICRO
        dx, groups = stage_backward_input([loss], None, [received], last.parameters())
        backward_weight(last.parameters(), groups)
        assert not bucket.launched, "the embedding's bucket waits for the first stage's backward"
        hidden.backward(dx[0])
        assert bucket.launched == (i == MICRO - 1)
    assert reducer.counts[embedding] == 2 * MICRO and bucket.launched
    assert reducer.launched_in_backward == len(buffers.buckets)

    reference = _model()
    for tokens, targets in _batches():
        (_loss(reference(tokens), targets) / MICRO).backward()
    got = buffers.grad_view(first.tok_embeddings.weight)
    torch.testing.assert_close(got, reference.tok_embeddings.weight.grad, rtol=1e-5, atol=1e-7)
    assert got.abs().sum() > 0
