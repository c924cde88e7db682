"""ZeRO optimizers on real gloo ranks against a single-process torch reference.

Every rank also runs the reference (torch AdamW + clip_grad_norm_ on the whole global batch,
one process's worth of work), so each rank can compare its own parameters.
"""

import numpy as np
import pytest
import torch

from tests.support.harness import dims_for, run_ranks
from tests.multirank.test_tensor import _shard
from tests.support.zero_ranks import (build, forward_backward, global_batch, loss_of, make_cfg, params_by_name,
                              reference_steps, train_step)
from trainer3d.model.init import canonical_name, init_parameters, tp_shard_of
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer
from trainer3d.parallel.finalize import GradFinalizer

STEPS = 3
# (stage, zero_reduce, bucket_mb): several buckets at 0.01 MiB (~2.6k fp32 elements each).
CONFIGS = {
    2: [(0, "auto", 0.01), (0, "auto", 100.0), (1, "all_reduce", 0.01), (1, "reduce_scatter", 0.01),
        (1, "reduce_scatter", 100.0), (2, "auto", 0.01), (3, "auto", 0.01)],
    4: [(0, "auto", 0.01), (1, "all_reduce", 0.01), (1, "reduce_scatter", 0.01)],
}


def _against_reference(rank, world):
    out = {}
    for stage, mode, bucket_mb in CONFIGS[world]:
        cfg = make_cfg(world, stage, bucket_mb=bucket_mb, zero_reduce=mode, grad_clip=0.5)
        dims, model, opt = build(cfg)
        norms = [train_step(model, opt, cfg, dims.dp_rank, s).item() for s in range(STEPS)]
        out[(stage, mode, bucket_mb)] = (_numpy(params_by_name(model, opt)), norms)
    ref_params, ref_norms = reference_steps(make_cfg(world, 0, grad_clip=0.5), STEPS)
    return out, _numpy(ref_params), ref_norms


def _numpy(params: dict) -> dict:
    """Tensors cross the process boundary by value (a shared-memory handle dies with its rank)."""
    return {n: t.numpy() for n, t in params.items()}


@pytest.mark.parametrize("dp", [2, 4])
def test_optimizer_step_equals_torch_adamw(dp):
    """Stages 0-3: parameters after 3 clipped AdamW steps and every step's global gradient norm
    equal torch AdamW + clip_grad_norm_ on the whole batch in one process."""
    results = run_ranks(_against_reference, dp, timeout=300)
    for rank, (out, ref_params, ref_norms) in enumerate(results):
        for key, (params, norms) in out.items():
            assert norms == pytest.approx(ref_norms, rel=1e-5), (rank, key)
            assert norms[0] > 0.5, "the clip must be active for this test to mean anything"
            for name, ref in ref_params.items():
                torch.testing.assert_close(torch.from_numpy(params[name]), torch.from_numpy(ref), rtol=1e-5, atol=4e-6,
                                           msg=f"{rank} {key} {name}")
    # Within a stage, the reduction mode and the bucket boundaries change nothing but the order
    # of sums (stage 1's buckets also move the owners' split of the norm's sum of squares).
    out = results[0][0]
    for key, (params, _) in out.items():
        first = next(p for k, (p, _) in out.items() if k[0] == key[0])
        for name in first:
            torch.testing.assert_close(torch.from_numpy(params[name]), torch.from_numpy(first[name]), rtol=0,
                                       atol=1e-6, msg=f"{key} {name}")


def _overlap(rank, world):
    cfg = make_cfg(world, 0, bucket_mb=0.01)
    dims, model, opt = build(cfg)
    reducer = opt.reducer
    n_buckets = len(opt.buffers.buckets)
    opt.zero_grad()
    x, y = global_batch(cfg, 0)
    accum = cfg.train.grad_accum_steps
    seen = []
    for m in range(accum):
        (loss_of(model, x[rank * accum + m], y[rank * accum + m]) / accum).backward()
        seen.append((list(reducer.launch_order), reducer.launched_in_backward,
                     sum(b.work is not None for b in opt.buffers.buckets)))
    opt.reduce_gradients()
    return n_buckets, seen


def test_buckets_launch_inside_the_last_micro_batch_backward():
    """No bucket launches before the last micro-batch; then all of them launch from the hooks
    (not from reduce_gradients), head first, as async work still pending when backward returns."""
    for n_buckets, seen in run_ranks(_overlap, 2, timeout=120):
        assert n_buckets >= 3
        (order_0, in_bwd_0, _), (order_1, in_bwd_1, pending) = seen
        assert order_0 == [] and in_bwd_0 == 0
        assert in_bwd_1 == n_buckets and sorted(order_1) == list(range(n_buckets))
        assert order_1[0] == 0, "the bucket holding the output head is ready first"
        assert pending == n_buckets


def _fp16_skip(rank, world, stage):
    cfg = make_cfg(world, stage, dtype="fp16")
    dims, model, opt = build(cfg)
    before = params_by_name(model, opt)
    opt.zero_grad()
    # One rank's overflow must make every rank skip. Stages 0/1: it arises in rank 1's backward
    # (a norm weight's gradient, before the bucket holding it is reduced: the buckets' all-reduces
    # run asynchronously from backward, a write into the buffer afterwards would race with them);
    # stage 3: in rank 1's reduced shard, which its norm counts.
    norm_weight = next(p for p in opt.parameters() if p.ndim == 1)
    hook = None
    if rank == 1 and stage < 2:
        hook = norm_weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    forward_backward(model, opt, cfg, dims.dp_rank, 0)
    if hook is not None:
        hook.remove()
    opt.reduce_gradients()
    if rank == 1 and stage >= 2:
        opt.grad(norm_weight).view(-1)[0] = float("inf")
    opt.clip_grad_norm(1.0)
    opt.step(1e-2)
    skipped = {k: v.item() for k, v in opt.step_metrics().items()}
    unchanged = all(torch.equal(before[n], p) for n, p in params_by_name(model, opt).items())
    step_after_skip = opt.step_count.item()
    train_step(model, opt, cfg, dims.dp_rank, 1)
    clean = {k: v.item() for k, v in opt.step_metrics().items()}
    changed = not any(torch.equal(before[n], p) for n, p in params_by_name(model, opt).items() if p.ndim == 2)
    return skipped, unchanged, step_after_skip, clean, changed, opt.scaler.scale.item()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage):
    for skipped, unchanged, step_after_skip, clean, changed, scale in run_ranks(_fp16_skip, 2, stage, timeout=180):
        assert skipped == {"loss_scale": 65536.0, "skipped": True}
        assert unchanged and step_after_skip == 0
        assert clean == {"loss_scale": 32768.0, "skipped": False} and changed and scale == 32768.0


def _grad_and_ownership(rank, world, mode):
    cfg = make_cfg(world, 1, zero_reduce=mode)
    dims, model, opt = build(cfg)
    opt.zero_grad()
    forward_backward(model, opt, cfg, dims.dp_rank, 0)
    opt.reduce_gradients()
    norm_w = model.layers["0"].attention_norm.weight
    opt.grad(norm_w).zero_()  # in place on grad(p): the step must see it (as the SP sync relies on)
    before = norm_w.detach().clone()
    opt.clip_grad_norm(1.0)
    opt.step(1e-2)
    owned = [(v.name, (v.start, v.end)) for v in opt.checkpoint_views() if "exp_avg" in v.tensors]
    sizes = {n: p.numel() for n, p in params_by_name(model, opt).items()}
    return torch.equal(before, norm_w.detach()), owned, sizes


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_stage1_grad_is_the_tensor_the_step_reads_and_owners_cover_every_element_once(mode):
    results = run_ranks(_grad_and_ownership, 4, mode, timeout=180)
    sizes = results[0][2]
    covered = {n: [] for n in sizes}
    for unchanged, owned, _ in results:
        assert unchanged, "a zeroed grad(p) of an undecayed parameter must leave it unchanged (Adam step 1)"
        for name, (lo, hi) in owned:
            covered[name].append((lo, hi))
    for name, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[name], name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (name, ranges)


# ----------------------------------------------------------------- ZeRO-2/3 with tensor parallelism

def _tp_fsdp(rank, world, stage, sp):
    """tp2 x dp2 under FSDP: the trainer's step (sequence-parallel sync included) on the
    vocabulary-parallel loss; this rank's tp slices after STEPS clipped steps, the reference's
    slices, every step's norm, and whether the tp marks survived sharding."""
    cfg = make_cfg(2, stage, grad_clip=0.5)
    cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, sp
    dims = dims_for(tp=2, dp=2)
    chunks = build_model_chunks(cfg, dims)
    marks = {canonical_name(n): tp_shard_of(p) for n, p in chunks[0].named_parameters()}
    opt = build_optimizer(chunks, cfg, dims)
    model, loss_fn, accum = chunks[0], build_loss_fn(cfg, dims, chunks), cfg.train.grad_accum_steps
    kept = marks == {canonical_name(n): tp_shard_of(p) for n, p in model.named_parameters()}
    grads = GradFinalizer(chunks, opt, dims, sp)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(cfg, step)
        for m in range(dims.dp_rank * accum, (dims.dp_rank + 1) * accum):
            (opt.scale_loss(loss_fn(model(x[m]), y[m])) / accum).backward()
        grads.finalize()
        norms.append(opt.clip_grad_norm(cfg.optim.grad_clip).item())
        opt.step(1e-2)
    ref_params, ref_norms = reference_steps(make_cfg(2, 0, grad_clip=0.5), STEPS)
    got = params_by_name(model, opt)  # gathered over dp, still tp slices
    named = {canonical_name(n): p for n, p in model.named_parameters()}
    want = {n: (_shard(ref_params[n], p) if tp_shard_of(p) is not None else ref_params[n]) for n, p in named.items()}
    return kept, norms, ref_norms, _numpy(got), _numpy(want)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_fsdp_with_tensor_parallelism_equals_torch_adamw(stage, sp):
    """The tensor-parallel marks survive fully_shard: replicated norm weights count once in the
    global norm (a gradient counted twice or summed wrongly changes it), and under sequence
    parallelism their dp-shard gradients are summed over tp (a wrong sum moves the weights).

    atol: tp alone (ZeRO-1, tp2 x dp2) ends 1.4e-5 from the reference here — Adam divides by
    sqrt(v), so elements with near-zero gradients turn reduction-order noise into lr-sized
    relative steps — so 3e-5; a wrong gradient moves weights by ~lr = 1e-2."""
    for rank, (kept, norms, ref_norms, got, want) in enumerate(run_ranks(_tp_fsdp, 4, stage, sp, timeout=300)):
        assert kept, "fully_shard dropped the tensor-parallel marks"
        assert norms == pytest.approx(ref_norms, rel=1e-5), rank
        assert norms[0] > 0.5, "the clip must be active for this test to mean anything"
        for name, ref in want.items():
            torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(ref), rtol=1e-5, atol=3e-5,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")


# ----------------------------------------------------------------- fp32 masters of a bf16 model

def _fsdp_masters(rank, world):
    """This rank's fp32 parameter shards (FSDP's masters) of a bf16 model right after
    construction, next to the same ranges of the 1-rank fp32 init."""
    cfg = make_cfg(world, 3, dtype="bf16")
    dims, model, opt = build(cfg)
    reference = Transformer(cfg.model)
    init_parameters(reference, cfg.model, cfg.train.seed)
    init = {n: p.detach().reshape(-1) for n, p in reference.named_parameters()}
    return [(v.tensors["param"].numpy().copy(), init[v.name][v.start:v.end].numpy().copy())
            for v in opt.checkpoint_views()]


def test_fsdp_bf16_masters_start_from_the_fp32_init():
    """Not from the bf16-rounded values: FSDP's fp32 parameters are the masters, so the model
    is built in fp32 for it and cast only for compute."""
    for rank, pairs in enumerate(run_ranks(_fsdp_masters, 2, timeout=120)):
        assert pairs, rank
        for master, init in pairs:
            assert master.dtype == np.float32
            np.testing.assert_array_equal(master, init)
        assert any(not np.array_equal(torch.from_numpy(init).bfloat16().float().numpy(), init) for _, init in pairs), \
            "the init must not be representable in bf16, or this test could not tell"
