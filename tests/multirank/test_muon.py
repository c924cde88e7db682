"""``optim.name=muon`` on real gloo ranks against one process of ``torch.optim.Muon`` (the
blocks' matrices) + ``torch.optim.AdamW`` (the rest) on the whole global batch.

The test's process runs the reference once per configuration (``_reference``); every rank
compares its own parameters (its tp slices) with it.
"""

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.multirank.test_tensor import _shard
from tests.support.harness import dims_for, run_ranks
from tests.support.tolerance import scaled_max_diff
from tests.support.zero_ranks import (global_batch, loss_of, make_cfg, muon_cfg, params_by_name, reference_muon_steps,
                                      torch_muon)
from trainer3d.optim.schedule import param_groups
from trainer3d.model.init import canonical_name, tp_shard_of
from trainer3d.parallel.finalize import GradFinalizer
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer

STEPS = 20
LR = 1e-2


def _cfg(dp, stage, adjust_lr, nesterov):
    return muon_cfg(make_cfg(dp, stage, grad_clip=0.5), adjust_lr, nesterov)


@functools.lru_cache(maxsize=None)
def _reference(dp, adjust_lr, nesterov):
    """torch's Muon + AdamW on the global batch of a dp-rank layout (ZeRO's stage does not change
    it), run once in the test's process (each xdist worker's) for the tests that share it: final
    parameters by canonical name as numpy arrays, every step's norm and loss."""
    params, norms, losses = reference_muon_steps(_cfg(dp, 0, adjust_lr, nesterov), STEPS, LR)
    return {n: t.numpy() for n, t in params.items()}, norms, losses


def _train(rank, world, tp, dp, stage, sp, reference, adjust_lr="original", nesterov=True):
    """STEPS clipped steps of the tiny model in tp x dp; this rank's parameters (tp slices), every
    step's global norm and dp-mean loss, and the reference's (``_reference``)."""
    cfg = _cfg(dp, stage, adjust_lr, nesterov)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sp
    dims = dims_for(tp=tp, dp=dp)
    chunks = build_model_chunks(cfg, dims)
    opt = build_optimizer(chunks, cfg, dims)
    model, loss_fn, accum = chunks[0], build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps
    grads = GradFinalizer(chunks, opt, dims, sp)
    start = params_by_name(model, opt)
    norms, losses = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(cfg, step)
        total = torch.zeros(())
        for m in range(dims.dp_rank * accum, (dims.dp_rank + 1) * accum):
            loss = loss_fn(model(x[m]), y[m]) / accum
            (opt.scale_loss(loss)).backward()
            total += loss.detach()
        if dp > 1:
            dist.all_reduce(total, group=dims.dp_group)
        losses.append(total.item() / dp)
        grads.finalize()
        norms.append(opt.clip_grad_norm(cfg.optim.grad_clip).item())
        opt.step(LR)
    ref_params, ref_norms, ref_losses = reference
    ref_params = {n: torch.from_numpy(a) for n, a in ref_params.items()}
    got = params_by_name(model, opt)
    named = {canonical_name(n): p for n, p in model.named_parameters()}
    want = {n: (_shard(ref_params[n], p) if tp_shard_of(p) is not None else ref_params[n]) for n, p in named.items()}
    return (norms, losses, ref_norms, ref_losses, {n: t.numpy() for n, t in got.items()},
            {n: t.numpy() for n, t in want.items()}, {n: t.numpy() for n, t in start.items()})


MOVED = 1e-3
"""How far a final parameter tensor may lie from the reference's, as a fraction of how far the
reference moved it in STEPS steps (Frobenius norms). Measured on AVX-512 kernels: up to 2.2e-5
(the attention's wq), the embedding 6.4e-5. Not element by element: AdamW divides by sqrt(v),
so an element whose gradient nearly cancels turns order-of-sums noise into an lr-sized
difference (one embedding element ended 1.4e-4 off where every other element of every tensor
was under 1e-5), while a wrong update is off by a good part of the whole tensor's movement."""


def _check(results):
    """Every step's dp-mean loss and global norm within rel 1e-5 of the reference; each final
    parameter tensor within MOVED of the reference's movement."""
    worst = 0.0
    for rank, (norms, losses, ref_norms, ref_losses, got, want, start) in enumerate(results):
        assert len(losses) == STEPS
        assert norms[0] > 0.5, "the clip must be active for this test to mean anything"
        assert losses == pytest.approx(ref_losses, rel=1e-5), rank
        assert norms == pytest.approx(ref_norms, rel=1e-5), rank
        worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)))
        for name, ref in want.items():
            off, moved = np.linalg.norm(got[name] - ref), np.linalg.norm(ref - start[name])
            assert off <= MOVED * moved, f"rank {rank} {name}: {off:.2e} from the reference, which moved {moved:.2e}"
    return worst


@pytest.mark.parametrize("adjust_lr,nesterov", [("original", True), ("match_rms_adamw", False)])
def test_one_process_equals_torch_muon_and_adamw(adjust_lr, nesterov):
    """One rank, ZeRO-0, Newton-Schulz in fp32 on both sides: every step's loss and norm and the
    final parameters equal torch's Muon + AdamW training on the same batches."""
    _check(run_ranks(_train, 1, 1, 1, 0, False, _reference(1, adjust_lr, nesterov), adjust_lr, nesterov, timeout=300))


@pytest.mark.parametrize("stage", [0, 1])
def test_dp2_equals_torch_muon(stage):
    """dp2: ZeRO-1 cuts matrices between the dp ranks' owned slices (bucket_mb=0.01 also cuts
    buckets mid-layer); each matrix is gathered whole before Newton-Schulz."""
    _check(run_ranks(_train, 2, 1, 2, stage, False, _reference(2, "original", True), timeout=300))


def test_tp2_sp_equals_torch_muon():
    """tp2 with sequence parallelism: column- and row-parallel weights gathered over tp."""
    _check(run_ranks(_train, 2, 2, 1, 0, True, _reference(1, "original", True), timeout=300))


@pytest.mark.slow
def test_tp2_dp2_zero1_equals_torch_muon():
    _check(run_ranks(_train, 4, 2, 2, 1, True, _reference(2, "original", True), timeout=600))


def _same_gradients(rank, world, adjust_lr, nesterov):
    """One rank, ns in bf16 (torch's own arithmetic): the engine steps on the gradients the torch
    reference computed, every step; its parameters after each step, and the reference's."""
    cfg = muon_cfg(make_cfg(1, 0, grad_clip=0.0), adjust_lr, nesterov, ns_dtype="bf16")
    dims = dims_for()
    chunks = build_model_chunks(cfg, dims)
    opt = build_optimizer(chunks, cfg, dims)
    engine = {canonical_name(n): p for n, p in chunks[0].named_parameters()}
    ref_model = build_model_chunks(make_cfg(1, 0), dims)[0]
    named = [(canonical_name(n), p) for n, p in ref_model.named_parameters()]
    hidden = [p for n, p in named if n.startswith("layers.") and p.ndim == 2]
    rest = [(n, p) for n, p in named if not (n.startswith("layers.") and p.ndim == 2)]
    muon = torch_muon(hidden, cfg, LR)
    adamw = torch.optim.AdamW(param_groups(rest, cfg.optim.weight_decay), lr=LR,
                              betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    worst = []
    for step in range(STEPS):
        x, y = global_batch(cfg, step)
        muon.zero_grad()
        adamw.zero_grad()
        for m in range(cfg.train.grad_accum_steps):
            (loss_of(ref_model, x[m], y[m]) / cfg.train.grad_accum_steps).backward()
        opt.zero_grad()
        opt.reduce_gradients()
        for n, p in named:
            opt.grad(engine[n]).copy_(p.grad)
        opt.clip_grad_norm(cfg.optim.grad_clip)
        opt.step(LR)
        muon.step()
        adamw.step()
        opt.wait_params()
        worst.append(max(scaled_max_diff(engine[n], p) for n, p in named))
    return worst


@pytest.mark.parametrize("adjust_lr,nesterov", [("original", True), ("match_rms_adamw", False)])
def test_step_on_the_same_gradients_equals_torch_muon_and_adamw(adjust_lr, nesterov):
    """Newton-Schulz in bf16, as torch's Muon: from the same gradients, every one of 20 steps
    leaves the parameters where torch.optim.Muon + AdamW leave them (no clip: a last-bit difference
    of its factor would flip bf16 roundings, so the Muon inputs are bit-identical)."""
    worst = run_ranks(_same_gradients, 1, adjust_lr, nesterov, timeout=300)[0]
    assert len(worst) == STEPS and max(worst) <= 1e-6, worst


def _moe_one_process(rank, world, steps):
    """One rank, fp32 Newton-Schulz, MoE blocks of 2 experts both chosen by every token (top_k=2:
    no discrete routing choice for a last-bit difference to flip): per parameter, how far it ends
    from the reference after ``steps`` steps as a fraction of the reference's movement (Frobenius,
    as MOVED), where torch's Muon steps each expert's matrix as a Parameter of its own (it takes
    2-D only)."""
    cfg = muon_cfg(make_cfg(1, 0, grad_clip=0.5))
    moe = cfg.model.moe
    moe.num_experts, moe.top_k, moe.expert_ffn_dim, moe.balance = 2, 2, 32, "none"
    dims = dims_for()
    chunks = build_model_chunks(cfg, dims)
    opt = build_optimizer(chunks, cfg, dims)
    model = chunks[0]
    engine = {canonical_name(n): p for n, p in model.named_parameters()}
    ref_model = build_model_chunks(cfg, dims)[0]
    named = [(canonical_name(n), p) for n, p in ref_model.named_parameters()]
    stacked = [p for n, p in named if n.startswith("layers.") and p.ndim == 3]
    assert stacked, "the MoE blocks' experts must be stacked 3-D weights for this test to mean anything"
    experts = [[torch.nn.Parameter(w[e].detach().clone()) for e in range(w.shape[0])] for w in stacked]
    hidden = [p for n, p in named if n.startswith("layers.") and p.ndim == 2] + [m for ms in experts for m in ms]
    rest = [(n, p) for n, p in named if not n.startswith("layers.") or p.ndim < 2]
    muon = torch_muon(hidden, cfg, LR)
    adamw = torch.optim.AdamW(param_groups(rest, cfg.optim.weight_decay), lr=LR,
                              betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    accum = cfg.train.grad_accum_steps
    start = {n: p.detach().clone() for n, p in named}
    for step in range(steps):
        x, y = global_batch(cfg, step)
        opt.zero_grad()
        for m in range(accum):
            (loss_of(model, x[m], y[m]) / accum).backward()
        opt.reduce_gradients()
        opt.clip_grad_norm(cfg.optim.grad_clip)
        opt.step(LR)
        ref_model.zero_grad()  # the stacked weights belong to neither optimizer
        muon.zero_grad()
        for m in range(accum):
            (loss_of(ref_model, x[m], y[m]) / accum).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], cfg.optim.grad_clip)
        for w, ms in zip(stacked, experts):
            for e, mat in enumerate(ms):
                mat.grad = w.grad[e].clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for w, ms in zip(stacked, experts):
                w.copy_(torch.stack([m.detach() for m in ms]))
    opt.wait_params()
    return {n: ((engine[n] - p).norm() / (p - start[n]).norm()).item() for n, p in named}


def test_moe_experts_are_orthogonalised_one_matrix_each():
    """A stacked (experts, in, out) weight: Muon per expert matrix, each scaled by its own shape."""
    worst = run_ranks(_moe_one_process, 1, 5, timeout=300)[0]
    assert any("experts" in n for n in worst)
    assert max(worst.values()) <= MOVED, worst  # measured up to 4.4e-5 of the movement
