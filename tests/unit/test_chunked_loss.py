"""The chunked loss (parallel/tensor/loss.py: the head applied inside the loss, a chunk of
tokens at a time) against torch's cross-entropy on the whole logits of the plain model: loss
and every parameter's gradient, fp32 and bf16, tied or not, any chunk size, tp ranks with a
padded vocabulary and sequence parallelism; and the whole logits never exist."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.memory.meter import SavedActivationMeter
from trainer3d.memory.states import planning_dims
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.parallelize import build_loss_fn

MODEL = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=16)


def _config(chunk: int, tied: bool = False, dtype: str = "fp32") -> Config:
    cfg = Config(model=copy.deepcopy(MODEL))
    cfg.model.tie_embeddings = tied
    cfg.train.loss_chunk_tokens, cfg.train.dtype = chunk, dtype
    return cfg


def _batch(b=3, s=7):
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, MODEL.vocab_size, (b, s), generator=g) for _ in range(2))
    y[0, :2] = torch.tensor([0, MODEL.vocab_size - 1])  # both ends of the vocabulary
    return x, y


def _reference(model, x, y):
    """torch's cross-entropy on the plain model's whole logits, in fp32."""
    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    (3 * loss).backward()
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 21, 64])
def test_chunked_loss_matches_the_whole_logits(dtype, tied, chunk):
    cfg = _config(chunk, tied)
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(dtype)
    ref = copy.deepcopy(model)
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    x, y = _batch()
    loss = loss_fn(model(x), y)
    (3 * loss).backward()
    want = _reference(ref, x, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == q.grad.dtype, name
        scale = q.grad.float().abs().max().item()
        if dtype == torch.float32:
            # The chunks sum the head's and every weight's gradient over the tokens in another
            # order than one matmul over all of them, and the BLAS blocks a sum by its thread
            # count: each of the two sums of n = tokens terms is within n * eps of the terms'
            # magnitude (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 3.1)
            tol = dict(rtol=1e-5, atol=x.numel() * torch.finfo(torch.float32).eps * scale)
        else:  # bf16: both round the logits' gradient to 8 bits, then sum in another order (a tied
            # embedding adds its two gradients in bf16): within two 8-bit steps of the largest value
            # (one step was met with 1 % to spare: two roundings of a value near the largest)
            tol = dict(rtol=2e-2, atol=2 ** -6 * scale)
        torch.testing.assert_close(p.grad.float(), q.grad.float(), **tol, msg=name)


def test_evaluation_computes_the_loss_alone():
    cfg = _config(4)
    model = Transformer(cfg.model)
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    x, y = _batch()
    with torch.no_grad():
        loss = loss_fn(model(x), y)
        want = F.cross_entropy(_logits_model(model)(x).flatten(0, 1), y.flatten())
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def _logits_model(model):
    plain = copy.deepcopy(model)
    plain.head_in_loss = False
    return plain


def test_zero_chunk_tokens_keeps_the_whole_logits():
    cfg = _config(0)
    model = Transformer(cfg.model)
    build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    x, _ = _batch()
    assert model(x).shape == (3, 7, MODEL.vocab_size)


def test_the_loss_saves_gradients_not_logits():
    """What the chunked loss keeps for backward: the hidden states' and the head's gradients
    (p sbh + p V h), no logits-sized buffer."""
    cfg = _config(4)
    model = Transformer(cfg.model)
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    x, y = _batch()
    hidden = model(x).detach().requires_grad_(True)
    meter = SavedActivationMeter(model.parameters())
    with meter:
        loss = loss_fn(hidden, y)
    n, h, v = x.numel(), MODEL.dim, MODEL.vocab_size
    assert meter.peak_bytes == 4 * n * h + 4 * v * h
    loss.backward()
    assert meter.live_bytes == 0


def _tp_case(rank, world, sp, tied):
    """The engine's tp layers and chunked loss on ``world`` ranks; rank's loss and gradients
    gathered back to the full shapes, against the plain one-process model."""
    from trainer3d.model.init import RandomInit, fill_parameters, tp_shard_of
    from trainer3d.parallel.parallelize import build_model_chunks

    cfg = _config(5, tied)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = world, sp
    cfg.train.seq_len = 8
    dims = dims_for(tp=world)
    (model,) = build_model_chunks(cfg, dims)
    ref = Transformer(cfg.model)  # the same layout-independent initial values, in one piece
    with torch.no_grad():
        fill_parameters(ref, RandomInit(cfg.model, cfg.train.seed))
    loss_fn = build_loss_fn(cfg, dims, [model])
    x, y = _batch(s=8)
    loss = loss_fn(model(x), y)
    (3 * loss).backward()
    want = _reference(ref, x, y)
    out = {"loss": abs(loss.item() - want.item())}
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad, full = p.grad, refs[name].grad
        shard = tp_shard_of(p)
        if shard is not None:
            size = p.shape[shard.dim]
            full = full.narrow(shard.dim, shard.rank * size, min(size, shard.full - shard.rank * size))
            if full.shape[shard.dim] < size:  # padded vocabulary rows: zero gradient
                out[f"{name} padding"] = grad.narrow(shard.dim, full.shape[shard.dim], size - full.shape[shard.dim]
                                                     ).abs().max().item()
                grad = grad.narrow(shard.dim, 0, full.shape[shard.dim])
        elif sp:
            torch.distributed.all_reduce(grad, group=dims.tp_group)  # norms see their tokens only
        out[name] = (grad - full).abs().max().item()
    return out


@pytest.mark.parametrize("sp,tied", [(False, False), (True, True)])
def test_chunked_loss_over_tp_ranks_matches_one_process(sp, tied):
    """tp = 2 with a vocabulary of 61 (one padded row on rank 1), sequence parallel or not."""
    for rank, diffs in enumerate(run_ranks(_tp_case, 2, sp, tied, timeout=300)):
        for what, diff in diffs.items():
            assert diff <= 1e-5, f"rank {rank} {what}: {diff:.2e}"


def test_the_heads_gradient_goes_into_its_fp32_sink():
    """bf16 weights with a ``MainGradSink`` (ZeRO 0/1, parallel/wgrad.py): the head's gradient
    is added into its fp32 buffer, scaled by the incoming gradient, and ``.grad`` stays empty."""
    from trainer3d.parallel.wgrad import MainGradSink

    cfg = _config(5)
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    head = model.output.weight
    sink = MainGradSink({head: torch.zeros(head.shape)})
    loss_fn = build_loss_fn(cfg, planning_dims(cfg, 0), [model])
    x, y = _batch()
    (3 * loss_fn(model(x), y)).backward()
    _reference(ref, x, y)
    assert head.grad is None
    want = ref.output.weight.grad.float()
    torch.testing.assert_close(sink.views[head], want, rtol=2e-2, atol=2 ** -7 * want.abs().max().item())
    sink.detach()
