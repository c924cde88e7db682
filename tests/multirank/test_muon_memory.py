"""Muon's step transient (trainer3d/memory/muon_step.py) against what real gloo ranks
allocate in ``opt.step``, op by op (tests/support/allocations.py): exact bytes."""

import pytest
import torch

from tests.support.allocations import AllocationMeter
from tests.support.harness import dims_for, run_ranks
from tests.support.zero_ranks import global_batch, make_cfg, muon_cfg
from trainer3d.memory.muon_step import muon_step_bytes
from trainer3d.memory.peak import rank_memory
from trainer3d.parallel.finalize import GradFinalizer
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer


def _step_peak(rank, world, tp, dp, stage, ns_dtype, experts):
    """The peak bytes allocated inside the second step's ``opt.step`` (the first has made
    anything lazy), and the accounting's ``muon_step`` transient for the same config."""
    cfg = muon_cfg(make_cfg(dp, stage), ns_dtype=ns_dtype)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, tp > 1
    if experts:  # MoE blocks: the experts' stacked 3-D weights, E matrices of 32 x 64 each
        moe = cfg.model.moe
        moe.num_experts, moe.top_k, moe.expert_ffn_dim, moe.balance = experts, 2, 64, "none"
    dims = dims_for(tp=tp, dp=dp)
    chunks = build_model_chunks(cfg, dims)
    opt = build_optimizer(chunks, cfg, dims)
    model, loss_fn, accum = chunks[0], build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps
    grads = GradFinalizer(chunks, opt, dims, tp > 1)
    meter = AllocationMeter()
    for step in range(2):
        opt.zero_grad()
        x, y = global_batch(cfg, step)
        for m in range(dims.dp_rank * accum, (dims.dp_rank + 1) * accum):
            opt.scale_loss(loss_fn(model(x[m]), y[m]) / accum).backward()
        grads.finalize()
        opt.clip_grad_norm(cfg.optim.grad_clip)
        with meter if step == 1 else torch.no_grad():
            opt.step(1e-2)
    return (meter.peak_bytes, rank_memory(cfg, 0).transients.get("muon_step"),
            muon_step_bytes(cfg, cfg.model.n_layers, dims.dp_rank))


# The tiny model (tests/support/zero_ranks.py: dim 32, ffn 64): its largest matrices are the
# SwiGLU's, 64 x 32 (N = 2048 elements, m = 32). Newton-Schulz holds the old and new X and two
# m x m (2 N + 2 m^2 elements); a tp-sharded one also its pieces and their concatenation (2 N fp32).
HAND_COUNT = {(1, "bf16"): 2 * (2 * 2048 + 2 * 32 * 32), (1, "fp32"): 4 * (2 * 2048 + 2 * 32 * 32),
              (2, "bf16"): 8 * 2048 + 2 * (2 * 2048 + 2 * 32 * 32),
              # 4 experts of 32 x 64 (N = 2048, m = 32): at torch.stack, the 4 results and their copy
              # (8 N) outgrow the last expert's iteration beside the 3 results before it (5 N + 2 m^2)
              (1, "bf16", 4): 2 * 8 * 2048}


@pytest.mark.parametrize("tp,dp,stage,ns_dtype,experts", [(1, 2, 1, "bf16", 0), (1, 2, 1, "fp32", 0),
                                                          (2, 1, 0, "bf16", 0), (1, 1, 0, "bf16", 4)],
                         ids=["dp2-zero1-bf16", "dp2-zero1-fp32", "tp2-bf16", "moe4-bf16"])
def test_muon_step_allocates_what_the_accounting_says(tp, dp, stage, ns_dtype, experts):
    """dp2 ZeRO-1: the dp gather and the layer-wise broadcasts are in place in the gradient
    buffer, the step allocates only Newton-Schulz's buffers (each rank owns SwiGLU matrices,
    the largest, so its own share's accounting is the group's); tp2: also the full fp32 matrix and its tp pieces. Every rank's
    measured peak equals the accounting (memory/peak.py's ``muon_step``, which the dry run and
    the planner read) to the byte, and the hand count; MoE: the experts one matrix each."""
    key = (tp, ns_dtype, experts) if experts else (tp, ns_dtype)
    results = run_ranks(_step_peak, tp * dp, tp, dp, stage, ns_dtype, experts, timeout=300)
    for rank, (measured, accounted, own_share) in enumerate(results):
        assert measured == accounted == own_share == HAND_COUNT[key], (rank, measured, accounted, own_share)
