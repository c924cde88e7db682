"""Layer-wise Muon (``optim.muon.layer_wise``, ZeRO-1): every matrix orthogonalised once per dp
group, and the same update as every rank orthogonalising every matrix.

The Newton-Schulz work a rank does is counted by torch's own ``FlopCounterMode`` inside
``opt.step`` (the step's only matmuls are Newton-Schulz's) and compared with the quintic's
FLOPs counted by hand for each full matrix: 5 iterations of X Xᵀ (2 m² n), A·A (2 m³) and
(bA + cA²) X (2 m² n), m <= n the matrix's sides.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.support.harness import dims_for, run_ranks
from tests.support.zero_ranks import global_batch, make_cfg, muon_cfg
from trainer3d.model.init import canonical_name, tp_shard_of
from trainer3d.parallel.finalize import GradFinalizer
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer

STEPS = 3


def _by_hand(rows: int, cols: int) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return 5 * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def _train(tp, dp, layer_wise):
    """STEPS steps of the tiny model in tp x dp ZeRO-1; the FLOPs counted in each step's
    ``opt.step``, the parameters after, and the full shapes of the rank's Muon matrices."""
    cfg = muon_cfg(make_cfg(dp, 1))
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, tp > 1
    cfg.optim.muon.layer_wise = layer_wise
    dims = dims_for(tp=tp, dp=dp)
    chunks = build_model_chunks(cfg, dims)
    opt = build_optimizer(chunks, cfg, dims)
    model, loss_fn, accum = chunks[0], build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps
    grads = GradFinalizer(chunks, opt, dims, tp > 1)
    flops = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(cfg, step)
        for m in range(dims.dp_rank * accum, (dims.dp_rank + 1) * accum):
            opt.scale_loss(loss_fn(model(x[m]), y[m]) / accum).backward()
        grads.finalize()
        opt.clip_grad_norm(cfg.optim.grad_clip)
        with FlopCounterMode(display=False) as counter:
            opt.step(1e-2)
        flops.append(counter.get_total_flops())
    opt.wait_params()
    shapes = []
    for n, p in model.named_parameters():
        if canonical_name(n).startswith("layers.") and p.ndim == 2:
            shape, shard = list(p.shape), tp_shard_of(p)
            if shard is not None:
                shape[shard.dim] = shard.full
            shapes.append(tuple(shape))
    return flops, {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}, shapes


def _both(rank, world, tp, dp):
    dims = dims_for(tp=tp, dp=dp)
    owner_flops, owner_params, shapes = _train(tp, dp, True)
    every_flops, every_params, _ = _train(tp, dp, False)
    same = all(torch.equal(owner_params[n], every_params[n]) for n in owner_params)
    return dims.tp_rank, owner_flops, every_flops, same, shapes


@pytest.mark.parametrize("tp,dp", [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)], ids=["dp2", "tp2-dp2"])
def test_each_matrix_is_orthogonalised_once_per_dp_group(tp, dp):
    """Summed over the dp ranks of a tp rank, the Newton-Schulz FLOPs of each step are those of
    every full matrix once (every rank doing some, none all of them); with layer_wise=false each
    rank does all of them. Both train bit-identical parameters (the owners' results broadcast)."""
    results = run_ranks(_both, tp * dp, tp, dp, timeout=900, pg_timeout_s=300)  # 4 ranks starve on a loaded 2-core host
    total = sum(_by_hand(r, c) for r, c in results[0][4])
    assert total > 0
    for tp_rank in range(tp):
        group = [r for r in results if r[0] == tp_rank]
        assert len(group) == dp
        for step in range(STEPS):
            shares = [r[1][step] for r in group]
            assert sum(shares) == total, (tp_rank, step, shares, total)
            assert all(0 < s < total for s in shares), shares
            assert [r[2][step] for r in group] == [total] * dp
    assert all(r[3] for r in results), "layer-wise and every-rank Newton-Schulz must train the same bits"
