"""Tensor-parallel layers and the tensor-parallel model against the 1-rank model.

Every rank builds the single-rank reference itself (same seed, same inputs), so each
comparison is local: a TP layer's output and gradients must equal the matching slice of
the reference's (every difference at most TOL x the reference's largest magnitude, fp32), for
tp in {2, 4}, with and without sequence parallelism. Weights of the layer tests are cut from
the reference by the test itself (not by the project's init), so the layers and the init are
checked independently.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.harness import dims_for, run_ranks
from tests.support.tolerance import scaled_max_diff

TOL = 1e-5
"""What ``scaled_max_diff`` may return (tests/support/tolerance.py: the largest difference relative
to the reference's largest element; a weight's gradient here is a sum of 16 products of N(0, 1)
values, up to ~10, where 1e-6 absolute is two ulps and AVX2's order of sums once missed it by
1.9e-6): measured up to 8e-7 on AVX-512 and AVX2 kernels."""
S, B = 8, 2  # sequence (divisible by tp=4 for sequence parallelism), batch: activations are sequence-first


def _shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` that ``param`` (a marked TP shard) holds, zero-padded at the end."""
    from trainer3d.model.init import tp_shard_of

    s = tp_shard_of(param)
    assert s is not None and full.shape[s.dim] == s.full
    local = param.shape[s.dim]
    pad = list(full.shape)
    pad[s.dim] = local * s.size - s.full
    padded = torch.cat([full, full.new_zeros(pad)], dim=s.dim)
    return padded.narrow(s.dim, s.rank * local, local)


def _seq(x: torch.Tensor, dims, sp: bool) -> torch.Tensor:
    """This rank's sequence shard of ``x`` under sequence parallelism, else ``x``."""
    return x.chunk(dims.tp, dim=0)[dims.tp_rank] if sp else x


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _load_shards(tp_module: nn.Module, ref: nn.Module) -> None:
    """Copy into every TP parameter its slice of the reference parameter of the same name."""
    from trainer3d.model.init import tp_shard_of

    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in tp_module.named_parameters():
            full = ref_params[name]
            p.copy_(_shard(full, p) if tp_shard_of(p) is not None else full)


def _compare_module(ref: nn.Module, tp_module: nn.Module, x: torch.Tensor, dims, sp_in: bool, sp_out: bool,
                    out_slice=None) -> dict:
    """Run both modules on x with the same upstream gradient; return max diffs of output,
    input gradient and every parameter gradient (against the reference's slice)."""
    from trainer3d.model.init import tp_shard_of

    g = torch.Generator().manual_seed(99)
    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=g)
    (y_ref * dy).sum().backward()

    x_tp = _leaf(_seq(x, dims, sp_in))
    y_tp = tp_module(x_tp)
    y_expect, dy_local = _seq(y_ref.detach(), dims, sp_out), _seq(dy, dims, sp_out)
    if out_slice is not None:
        y_expect, dy_local = out_slice(y_expect), out_slice(dy_local)
    (y_tp * dy_local).sum().backward()
    diffs = {"output": scaled_max_diff(y_tp.detach(), y_expect),
             "input.grad": scaled_max_diff(x_tp.grad, _seq(x_ref.grad, dims, sp_in))}
    ref_params = dict(ref.named_parameters())
    for name, p in tp_module.named_parameters():
        full = ref_params[name].grad
        diffs[f"{name}.grad"] = scaled_max_diff(p.grad, _shard(full, p) if tp_shard_of(p) is not None else full)
    return diffs


def _ref_linear(n_in: int, n_out: int) -> nn.Linear:
    """A reference layer at the model's init scale (std 0.02)."""
    ref = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(ref.weight, std=0.02)
    return ref


def _layer_cases(rank, world_size, sp):
    from trainer3d.config.schema import ModelConfig
    from trainer3d.model.init import init_parameters
    from trainer3d.model.transformer import Attention, FeedForward
    from trainer3d.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           parallelize_attention, parallelize_feed_forward)

    dims = dims_for(tp=world_size)
    torch.manual_seed(0)  # same reference weights and inputs on every rank
    enter, leave = ("gather", "reduce_scatter") if sp else ("copy", "all_reduce")
    results = {}

    ref = _ref_linear(16, 24)
    col = ColumnParallelLinear(16, 24, dims, enter)
    _load_shards(col, ref)
    local = 24 // dims.tp
    results["column"] = _compare_module(ref, col, torch.randn(S, B, 16), dims, sp, False,
                                        out_slice=lambda t: t[..., dims.tp_rank * local:(dims.tp_rank + 1) * local])

    ref = _ref_linear(24, 16)
    row = RowParallelLinear(24, 16, dims, leave)
    _load_shards(row, ref)
    x = torch.randn(S, B, 24)
    x_ref = _leaf(x)
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape)
    (y_ref * dy).sum().backward()
    cols = slice(dims.tp_rank * local, (dims.tp_rank + 1) * local)
    x_tp = _leaf(x[..., cols])
    y_tp = row(x_tp)
    (y_tp * _seq(dy, dims, sp)).sum().backward()
    results["row"] = {"output": scaled_max_diff(y_tp.detach(), _seq(y_ref.detach(), dims, sp)),
                      "input.grad": scaled_max_diff(x_tp.grad, x_ref.grad[..., cols]),
                      "weight.grad": scaled_max_diff(row.weight.grad, _shard(ref.weight.grad, row.weight))}

    ref = nn.Embedding(257, 16)  # 257 = 2 * 128 + 1 = 4 * 64 + 1: the last rank holds padding
    nn.init.normal_(ref.weight, std=0.02)
    emb = VocabParallelEmbedding(257, 16, dims, leave)
    _load_shards(emb, ref)
    tokens = torch.randint(0, 257, (S, B))
    tokens[:3, 0] = torch.tensor([0, 256, 128])  # both ends and a shard boundary
    y_ref = ref(tokens)
    dy = torch.randn(y_ref.shape)
    (y_ref * dy).sum().backward()
    y_tp = emb(tokens)
    (y_tp * _seq(dy, dims, sp)).sum().backward()
    results["embedding"] = {"output": scaled_max_diff(y_tp.detach(), _seq(y_ref.detach(), dims, sp)),
                            "weight.grad": scaled_max_diff(emb.weight.grad, _shard(ref.weight.grad, emb.weight))}

    cfg = ModelConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=257, max_seq_len=S)
    ref = Attention(cfg)
    init_parameters(ref, cfg, seed=1)  # the model's own init scale; the shards are still cut here
    with torch.device("meta"):
        attn = Attention(cfg)
    parallelize_attention(attn, dims, sp)
    attn.to_empty(device="cpu")
    _load_shards(attn, ref)
    results["attention_gqa"] = _compare_module(ref, attn, torch.randn(S, B, 64), dims, sp, sp)

    ref = FeedForward(cfg)
    init_parameters(ref, cfg, seed=1)
    ffn = FeedForward(cfg)
    parallelize_feed_forward(ffn, dims, sp)
    _load_shards(ffn, ref)
    results["swiglu"] = _compare_module(ref, ffn, torch.randn(S, B, 64), dims, sp, sp)
    return results


def _loss_case(rank, world_size):
    from trainer3d.parallel.tensor.loss import vocab_parallel_cross_entropy, vocab_range

    dims = dims_for(tp=world_size)
    torch.manual_seed(0)
    vocab = 257
    logits = torch.randn(B, S, vocab) * 3
    targets = torch.randint(0, vocab, (B, S))
    targets[0, :2] = torch.tensor([0, vocab - 1])
    ref_logits = _leaf(logits)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()

    start, local, valid = vocab_range(vocab, dims.tp, dims.tp_rank)
    garbage = torch.full((B, S, local * dims.tp - vocab), 1e4)  # padded columns must not count
    shard = torch.cat([logits, garbage], dim=-1)[..., start:start + local]
    out = {}
    # batch-first memory, and the model's own: a batch-first view of sequence-first memory
    for layout, local_logits in (("", shard), ("seq-first ", shard.transpose(0, 1).contiguous().transpose(0, 1))):
        mine = _leaf(local_logits)
        loss = vocab_parallel_cross_entropy(mine, targets, vocab, dims)
        loss.backward()
        out.update({f"{layout}loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                    f"{layout}logits.grad": scaled_max_diff(mine.grad[..., :valid], ref_logits.grad[..., start:start + valid]),
                    f"{layout}padding.grad": mine.grad[..., valid:].abs().max().item() if valid < local else 0.0})
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_single_rank(tp):
    for sp in (False, True):
        for rank, per_layer in enumerate(run_ranks(_layer_cases, tp, sp, timeout=300)):
            for layer, diffs in per_layer.items():
                for what, diff in diffs.items():
                    assert diff <= TOL, f"tp={tp} sp={sp} rank {rank} {layer} {what}: {diff:.2e}"


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(tp):
    for rank, diffs in enumerate(run_ranks(_loss_case, tp, timeout=300)):
        for what, diff in diffs.items():
            assert diff <= TOL, f"tp={tp} rank {rank} {what}: {diff:.2e}"


def test_sequence_collectives_work_on_the_activations_themselves(monkeypatch):
    """Sequence-first activations: the all-gather sends the shard itself and returns the
    buffer it gathered into, the reduce-scatter likewise (no copy on either side)."""
    from trainer3d.parallel.tensor import comm as tensor_comm

    calls = []

    def gather(out, x, group):
        calls.append((out, x))
        out.copy_(torch.cat([x, x + 1]))

    def reduce_scatter(out, x, group):
        calls.append((out, x))
        out.copy_(x[:len(out)] + x[len(out):])

    monkeypatch.setattr(tensor_comm, "_size", lambda group: 2)
    monkeypatch.setattr(tensor_comm, "all_gather_single", gather)
    monkeypatch.setattr(tensor_comm, "reduce_scatter_single", reduce_scatter)
    shard = torch.randn(S // 2, B, 4)  # (seq / tp, batch, dim)
    full = tensor_comm.all_gather_seq(shard, None)
    (out, sent), = calls
    assert sent is shard and full is out and full.shape == (S, B, 4)
    torch.testing.assert_close(full[S // 2:], shard + 1)
    summed = tensor_comm.reduce_scatter_seq(full, None)
    out, sent = calls[1]
    assert sent is full and summed is out
    torch.testing.assert_close(summed, 2 * shard + 1)
