"""The whole tensor-parallel model (odd vocabulary, GQA) against the 1-rank model.

Built through the real path (``build_model_chunks``: meta build -> TP -> materialise ->
layout-independent init), on tp in {2, 4}, with and without sequence parallelism:
- the initial shards are the slices of the 1-rank model's tensors (padding rows zero);
- the loss equals the 1-rank loss and every parameter's gradient equals its slice of the
  1-rank gradient (padding rows' gradient exactly zero), after the sequence-parallel sync;
- the global gradient norm counts replicated parameters once (equals the 1-rank norm);
- padded vocabulary rows never change the loss, whatever they hold;
- measured per-rank bytes of the split weights are full / tp (vocabulary: padded / tp),
  replicated weights are whole;
- after optimizer steps the replicated norm weights are identical on every tp rank.
"""

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import dims_for, run_ranks
from tests.multirank.test_tensor import TOL, _shard
from tests.support.tolerance import scaled_max_diff

VOCAB, B, S = 257, 2, 16
VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")


def _valid_rows(weight, dims) -> int:
    """Rows of this rank's vocabulary shard below VOCAB (the rest is padding)."""
    rows = weight.shape[0]
    return max(0, min(rows, VOCAB - dims.tp_rank * rows))


def _config(tp: int, sp: bool):
    from trainer3d.config.schema import Config, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=VOCAB,
                            max_seq_len=S)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sp
    cfg.train.seed = 5
    return cfg


def _whole_model(rank, world_size, sp):
    from trainer3d.model.init import init_parameters, tp_shard_of
    from trainer3d.model.transformer import Transformer, cross_entropy_loss
    from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks
    from trainer3d.parallel.finalize import GradFinalizer
    from trainer3d.parallel.zero.flat import ReplicatedOptimizer

    dims = dims_for(tp=world_size)
    cfg = _config(world_size, sp)
    chunks = build_model_chunks(cfg, dims)
    model = chunks[0]
    ref = Transformer(cfg.model)
    init_parameters(ref, cfg.model, cfg.train.seed)
    ref_params = dict(ref.named_parameters())
    out = {"init": 0.0, "grad": 0.0, "padding.grad": 0.0, "split_bytes": 0, "split_full_bytes": 0,
           "replicated_bytes": 0, "replicated_full_bytes": 0, "vocab_bytes": 0}
    for name, p in model.named_parameters():
        sharded = tp_shard_of(p) is not None
        want = _shard(ref_params[name].detach(), p) if sharded else ref_params[name].detach()
        out["init"] = max(out["init"], scaled_max_diff(p.detach(), want))
        nbytes, full = p.untyped_storage().nbytes(), ref_params[name].untyped_storage().nbytes()
        if name in VOCAB_PARAMS:
            out["vocab_bytes"] += nbytes
        elif sharded:
            out["split_bytes"], out["split_full_bytes"] = out["split_bytes"] + nbytes, out["split_full_bytes"] + full
        else:
            out["replicated_bytes"] += nbytes
            out["replicated_full_bytes"] += full

    g = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, VOCAB, (2, B, S), generator=g)
    tokens[0, :2], targets[0, :2] = torch.tensor([VOCAB - 1, 0]), torch.tensor([0, VOCAB - 1])
    ref_loss = cross_entropy_loss(ref(tokens), targets)
    ref_loss.backward()
    loss_fn = build_loss_fn(cfg, dims)
    # The optimizer owns the gradients (its hooks accumulate them into one fp32 buffer): build it
    # before backward and read each parameter's gradient through it, as the trainer does.
    optimizer = ReplicatedOptimizer(chunks, cfg, dims)
    grads = GradFinalizer(chunks, optimizer, dims, sp)
    optimizer.zero_grad()
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    grads.finalize()
    out["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    for name, p in model.named_parameters():
        full, grad = ref_params[name].grad, optimizer.grad(p)
        expect = _shard(full, p) if tp_shard_of(p) is not None else full
        valid = _valid_rows(p, dims) if name in VOCAB_PARAMS else p.shape[0]
        out["grad"] = max(out["grad"], scaled_max_diff(grad[:valid], expect[:valid]))
        out["padding.grad"] = max(out["padding.grad"], grad[valid:].abs().max().item() if valid < p.shape[0] else 0)
    ref_norm = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
    out["grad_norm_rel"] = abs(optimizer.clip_grad_norm(0.0).item() - ref_norm.item()) / ref_norm.item()

    # Padded vocabulary rows (the tail of the last rank) never change the loss.
    with torch.no_grad():
        before = loss_fn(model(tokens), targets)
        for layer in (model.tok_embeddings, model.output):
            w = layer.weight
            valid = _valid_rows(w, dims)
            if valid < w.shape[0]:
                w[valid:] = torch.randn(w[valid:].shape) * 100
        out["padding_changes_loss"] = not torch.equal(before, loss_fn(model(tokens), targets))

    # Replicated parameters stay identical over tp through optimizer steps.
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn(model(tokens), targets).backward()
        grads.finalize()
        optimizer.clip_grad_norm(1.0)
        optimizer.step(1e-2)
    flat = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if tp_shard_of(p) is None])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat, group=dims.tp_group)
    out["replicas_equal"] = all(torch.equal(gathered[0], t) for t in gathered)
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_whole_model_matches_single_rank(tp, sp):
    per_rank = run_ranks(_whole_model, tp, sp, timeout=300)
    for rank, r in enumerate(per_rank):
        where = f"tp={tp} sp={sp} rank {rank}"
        # bit for bit: a single rare token's row drawn differently would move step 0's loss
        # by less than any tolerance and the trajectory only later
        assert r["init"] == 0.0, f"{where}: the initial parameters differ by {r['init']:.2e}"
        for what in ("loss", "grad"):
            assert r[what] <= TOL, f"{where}: {what} differs by {r[what]:.2e}"
        assert r["padding.grad"] == 0.0, f"{where}: padding rows got a gradient"
        assert r["grad_norm_rel"] <= 1e-6, f"{where}: grad norm off by {r['grad_norm_rel']:.2e} (relative)"
        assert not r["padding_changes_loss"], f"{where}: padded vocabulary rows changed the loss"
        assert r["replicas_equal"], f"{where}: replicated parameters drifted apart over tp"
        # Measured bytes: split weights hold 1/tp, the (padded) vocabulary ceil(V/tp) rows each.
        assert r["split_bytes"] * tp == r["split_full_bytes"], where
        assert r["vocab_bytes"] == 2 * -(-VOCAB // tp) * 64 * 4, where
        assert r["replicated_bytes"] == r["replicated_full_bytes"] > 0, where
