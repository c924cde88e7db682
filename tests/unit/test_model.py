"""The parallelism-agnostic model and its layout-independent initialisation."""

import torch
import torch.nn.functional as F

from tests.support.tolerance import assert_close_to_scale
from trainer3d.config.schema import ModelConfig
from trainer3d.model.init import RandomInit, full_init, full_shape, init_parameters, mark_tp_shard, tp_shard_of
from trainer3d.model.transformer import Transformer, count_parameters, cross_entropy_loss, token_rows

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=32)


def build(cfg=CFG, seed=0):
    model = Transformer(cfg)
    init_parameters(model, cfg, seed)
    return model


def test_shapes_and_parameter_count():
    model = build()
    tokens = torch.randint(0, CFG.vocab_size, (3, 16))
    assert model(tokens).shape == (3, 16, CFG.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(CFG)
    assert all(not n.endswith("bias") for n, _ in model.named_parameters())


def test_causal():
    model = build()
    tokens = torch.randint(0, CFG.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % CFG.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_grouped_query_attention_equals_repeated_heads():
    """GQA with 2 kv-heads == MHA whose kv projections repeat each kv-head's weights."""
    gqa = build()
    mha_cfg = ModelConfig(**{**CFG.__dict__, "n_kv_heads": CFG.n_heads})
    mha = Transformer(mha_cfg)
    state = gqa.state_dict()
    hd, rep = CFG.dim // CFG.n_heads, CFG.n_heads // CFG.n_kv_heads
    for name in list(state):
        if name.endswith(("wk.weight", "wv.weight")):
            w = state[name].view(CFG.n_kv_heads, hd, CFG.dim)
            state[name] = w.repeat_interleave(rep, dim=0).reshape(CFG.n_heads * hd, CFG.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_loss_matches_torch_reference():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    expected = F.cross_entropy(logits.reshape(10, 11), targets.reshape(10))
    torch.testing.assert_close(cross_entropy_loss(logits, targets), expected)


def test_logits_are_a_batch_first_view_the_loss_reads_without_a_copy():
    """The model computes sequence-first and returns (batch, seq, vocab) as a view; the loss
    flattens the tokens in memory order (no logits-sized copy), the targets following them."""
    model = Transformer(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (3, 12))
    logits = model(tokens)
    assert logits.shape == (3, 12, CFG.vocab_size) and logits.transpose(0, 1).is_contiguous()
    rows, row_targets = token_rows(logits, tokens)
    assert rows.data_ptr() == logits.data_ptr() and rows.is_contiguous()
    torch.testing.assert_close(row_targets, tokens.t().flatten())
    expected = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tokens.reshape(-1))
    torch.testing.assert_close(cross_entropy_loss(logits, tokens), expected)


def test_initialisation_is_deterministic_and_seeded():
    a, b, c = build(seed=3), build(seed=3), build(seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n


def test_initialisation_does_not_depend_on_other_parameters():
    """A pipeline stage that holds fewer layers gets the same values for the ones it has."""
    full = build(seed=7)
    stage = Transformer(CFG)
    del stage.layers["0"]
    stage.tok_embeddings = None
    init_parameters(stage, CFG, seed=7)
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name


def local_init(name: str, param: torch.Tensor, cfg, seed: int) -> torch.Tensor:
    """A rank's slice of ``full_init`` for ``param``, drawn as a rank draws it (RandomInit with its shard)."""
    shard = tp_shard_of(param)
    return RandomInit(cfg, seed)(name, full_shape(param.shape, shard), shard)


def test_tp_shard_init_is_a_slice_of_the_full_tensor_with_zero_padding():
    vocab, dim, tp = 101, 8, 4  # 101 rows padded to 104 = 4 x 26
    full = full_init("tok_embeddings.weight", (vocab, dim), CFG, seed=1)
    pieces = []
    for rank in range(tp):
        shard = mark_tp_shard(torch.nn.Parameter(torch.empty(26, dim)), dim=0, rank=rank, size=tp, full=vocab)
        pieces.append(local_init("tok_embeddings.weight", shard, CFG, seed=1))
    stacked = torch.cat(pieces)
    assert torch.equal(stacked[:vocab], full)
    assert torch.equal(stacked[vocab:], torch.zeros(3, dim))
    col = [local_init("layers.0.attention.wo.weight",
                      mark_tp_shard(torch.nn.Parameter(torch.empty(dim, 16)), dim=1, rank=r, size=2, full=32), CFG, 1)
           for r in range(2)]
    torch.testing.assert_close(torch.cat(col, dim=1), full_init("layers.0.attention.wo.weight", (dim, 32), CFG, 1),
                               rtol=0, atol=0)


def test_fused_loss_on_one_rank_matches_torch_in_loss_and_gradient():
    """The engine's loss at tp = 1 (parallel/tensor/loss.py, no collectives) against torch's
    cross-entropy on fp32 logits; 16-bit logits against torch on their fp32 values."""
    from trainer3d.config.schema import Config
    from trainer3d.memory.states import planning_dims
    from trainer3d.parallel.parallelize import build_loss_fn

    cfg = Config(model=CFG)
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0))
    torch.manual_seed(0)  # the inputs of every order the tests run in
    targets = torch.randint(0, CFG.vocab_size, (3, 7))
    for dtype in (torch.float32, torch.bfloat16):
        logits = (4 * torch.randn(3, 7, CFG.vocab_size)).to(dtype).requires_grad_(True)
        ref_logits = logits.detach().float().requires_grad_(True)
        loss, ref = loss_fn(logits, targets), F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
        (2 * loss).backward()
        (2 * ref).backward()
        assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        if dtype == torch.float32:  # at each target p - 1 cancels: within the largest element's rounding
            assert_close_to_scale(logits.grad, ref_logits.grad)
        else:  # bf16: the gradient rounded to 8 bits
            torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=8e-3, atol=1e-5)
