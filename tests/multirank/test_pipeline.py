"""Pipelined steps on gloo ranks against one process: losses, gradients, activation memory.
(The measured bubble against theory: tests/tools/test_bench_pipeline.py.)"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config, ModelConfig
from trainer3d.model.init import init_parameters
from trainer3d.model.transformer import Transformer, cross_entropy_loss
from trainer3d.parallel.parallelize import build_model_chunks, build_optimizer
from trainer3d.memory.meter import SavedActivationMeter
from trainer3d.parallel.pipeline.receive_count import receive_buffers_held
from trainer3d.parallel.pipeline.bubble import bubble_theory
from trainer3d.parallel.pipeline.schedule import SCHEDULES, SINGLE_STAGE, Pipeline
from trainer3d.parallel.pipeline.stages import rank_of_stage, stages_of_rank
from trainer3d.parallel.pipeline.timeline import schedule_actions, simulate
from trainer3d.parallel.pipeline.losses import MicroBatchLoss

TINY = ModelConfig(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16)
MICRO, SEQ = 2, 16


def _cfg(pp, schedule, virtual_stages, n_micro, dp=1):
    cfg = Config()
    cfg.model = TINY
    p = cfg.parallel
    p.pp, p.dp, p.pp_schedule, p.pp_virtual_stages = pp, dp, schedule, virtual_stages
    cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.train.global_batch_size = MICRO, n_micro, None
    cfg.train.seq_len, cfg.train.seed = SEQ, 7
    return cfg


def _batch(n_micro, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (n_micro, MICRO, SEQ), generator=g)
    return x, torch.randint(0, TINY.vocab_size, (n_micro, MICRO, SEQ), generator=g)


def _pipeline(cfg, dims, chunks=None):
    chunks = chunks or build_model_chunks(cfg, dims)
    micro_loss = MicroBatchLoss(cross_entropy_loss, cfg.train.grad_accum_steps, build_optimizer(chunks, cfg, dims))
    return chunks, micro_loss, Pipeline(chunks, micro_loss, cfg, dims)


def pipelined_steps(rank, world, pp, schedule, virtual_stages, n_micro):
    """Two steps on the same batch without zeroing: the gradient must be twice one step's.
    Also the compute actions the rank ran in its last step, in order."""
    cfg = _cfg(pp, schedule, virtual_stages, n_micro)
    chunks, micro_loss, pipe = _pipeline(cfg, dims_for(pp=pp))
    x, y = _batch(n_micro)
    losses = []
    for _ in range(2):
        pipe.forward_backward(x, y)
        losses.append([loss.item() for loss in micro_loss.losses.values()])
        micro_loss.pop_mean()
    grads = {n: p.grad.numpy().copy() for c in chunks for n, p in c.named_parameters()}
    return losses, grads, tuple(pipe.executed)


def reference_steps(n_micro):
    model = Transformer(TINY)
    init_parameters(model, TINY, seed=7)
    x, y = _batch(n_micro)
    losses = []
    for _ in range(2):
        step = []
        for m in range(n_micro):
            loss = cross_entropy_loss(model(x[m]), y[m])
            (loss / n_micro).backward()
            step.append(loss.item())
        losses.append(step)
    return losses, {n: p.grad.numpy() for n, p in model.named_parameters()}


CASES = [("1f1b", 2, 1, 4), ("gpipe", 2, 1, 3), ("interleaved_1f1b", 2, 2, 3),
         ("1f1b", 4, 1, 5), ("gpipe", 4, 1, 2), ("interleaved_1f1b", 4, 2, 6),
         ("zbv", 2, 2, 3), ("dualpipev", 2, 2, 4), ("zb1p", 2, 2, 4), ("zbv", 4, 2, 8)]


@pytest.mark.parametrize("schedule,pp,virtual_stages,n_micro", CASES, ids=[f"{c[0]}-pp{c[1]}-m{c[3]}" for c in CASES])
def test_pipelined_losses_and_grads_equal_one_process(schedule, pp, virtual_stages, n_micro):
    torch.set_num_threads(1)
    results = run_ranks(pipelined_steps, pp, pp, schedule, virtual_stages, n_micro, timeout=300)
    ref_losses, ref_grads = reference_steps(n_micro)
    # Losses exist on the last stage's rank only (rank 0 in a V), exactly one per micro-batch
    # (no shape-inference extra).
    owner = rank_of_stage(pp * virtual_stages - 1, pp, schedule)
    assert all(r[0] == [[], []] for rank, r in enumerate(results) if rank != owner)
    np.testing.assert_allclose(results[owner][0], ref_losses, rtol=1e-6)
    grads = {}
    for _, rank_grads, _ in results:
        assert not set(rank_grads) & set(grads), "a parameter on two stages"
        grads.update(rank_grads)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        np.testing.assert_allclose(grads[name], ref, rtol=1e-5, atol=1e-8, err_msg=name)
    # The order the stages ran is the order the planner reasons about (timeline.py), and the
    # bubble of that executed order with unit costs is the planner's.
    executed = {rank: r[2] for rank, r in enumerate(results)}
    assert executed == schedule_actions(schedule, pp, virtual_stages, n_micro)
    bubble = simulate(executed, virtual_stages).bubble()
    if schedule == "interleaved_1f1b":  # the exact idle share of an ideal interleaved step (bubble.py)
        assert bubble == pytest.approx((pp - 1) / (virtual_stages * n_micro + pp - 1), rel=1e-12)
    else:  # 1F1B and GPipe: the textbook (p - 1) / (m + p - 1); zero-bubble: the planner's figure
        assert bubble == pytest.approx(bubble_theory(pp, n_micro, virtual_stages, schedule), rel=1e-12)


def test_too_few_micro_batches_fail_before_any_send():
    cfg = _cfg(4, "1f1b", 1, 3)
    with pytest.raises(ValueError, match=r"train.grad_accum_steps=3 < parallel.pp=4: 1f1b"):
        Pipeline([], None, cfg, SimpleNamespace(pp_rank=0))


# ----------------------------------------------------------------- activation memory

def _one_micro_batch_bytes(chunk, stage, n_stages, x, y):
    """Saved-activation bytes of one micro-batch's forward (and loss) on this stage, alone."""
    if stage > 0:
        x = torch.randn(SEQ, MICRO, TINY.dim, requires_grad=True)  # hidden states are sequence-first
    with SavedActivationMeter(chunk.parameters()) as meter:
        out = chunk(x)
        if stage == n_stages - 1:
            out = cross_entropy_loss(out, y)
        peak = meter.peak_bytes
    out.sum().backward()
    chunk.zero_grad(set_to_none=True)
    return peak


def activation_peaks(rank, world, pp, n_micros):
    """Per schedule and micro-batch count: this stage's peak saved-activation bytes in a step."""
    dims = dims_for(pp=pp)
    chunks = None
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        for n_micro in n_micros:
            chunks, micro_loss, pipe = _pipeline(_cfg(pp, schedule, 1, n_micro), dims, chunks)
            x, y = _batch(n_micro)
            pipe.forward_backward(x, y)  # the first step also infers shapes: not measured
            meter = SavedActivationMeter([p for c in chunks for p in c.parameters()])
            with meter:
                pipe.forward_backward(x, y)
            assert meter.live_bytes == 0, "every saved activation is released by the end of the step"
            peaks[schedule, n_micro] = meter.peak_bytes
            micro_loss.pop_mean()
    x, y = _batch(1)
    one = _one_micro_batch_bytes(chunks[0], rank, pp, x[0], y[0])
    return peaks, one


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_bounds_activation_memory_gpipe_does_not(pp):
    torch.set_num_threads(1)
    # "many": enough that GPipe's peak (every micro-batch) is twice 1F1B's bound (pp - stage)
    # on every stage; more micro-batches are more rounds of sends and prove nothing more.
    few, many = pp, 2 * pp
    results = run_ranks(activation_peaks, pp, pp, (few, many), timeout=300)
    for stage, (peaks, one) in enumerate(results):
        assert one > 0
        # 1F1B: stage s holds at most pp - s micro-batches in flight, whatever grad_accum is.
        assert peaks["1f1b", many] == pytest.approx(peaks["1f1b", few], rel=0.10), (stage, peaks)
        assert peaks["1f1b", few] == pytest.approx((pp - stage) * one, rel=0.10), (stage, peaks, one)
        # GPipe: every micro-batch's activations live until the first backward.
        for n_micro in (few, many):
            assert peaks["gpipe", n_micro] == pytest.approx(n_micro * one, rel=0.10), (stage, n_micro, peaks, one)


# ----------------------------------------------------------------- receive buffers

def _stock_receive_bytes(chunks, cfg, dims, x, y) -> int:
    """torch's own PipelineStage on the same chunks: the bytes its receive buffers hold after a step."""
    p = cfg.parallel
    n_stages = p.pp * p.pp_virtual_stages
    ids = stages_of_rank(dims.pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule)
    stages = [PipelineStage(c, s, n_stages, dims.device, group=dims.pp_group) for s, c in zip(ids, chunks)]
    schedule = SCHEDULES[p.pp_schedule]
    loss = lambda out, target: cross_entropy_loss(out, target) / cfg.train.grad_accum_steps  # noqa: E731
    run = schedule(stages[0] if p.pp_schedule in SINGLE_STAGE else stages, cfg.train.grad_accum_steps,
                   loss_fn=loss, scale_grads=False)
    first, last = 0 in ids, n_stages - 1 in ids
    run.step(*((x.flatten(0, 1),) if first else ()), target=y.flatten(0, 1) if last else None)
    infos = [i for s in stages for recv in (*s.args_recv_info.values(), *s.grad_recv_info.values()) for i in recv]
    return sum(i.buffer.untyped_storage().nbytes() for i in infos if i.buffer is not None)


def receive_buffers(rank, world, pp, schedule, virtual_stages, n_micro):
    """Peak receive-buffer bytes of a step (the second: the first infers shapes), the bytes left
    after it, and what torch's stock stages hold for the same step."""
    cfg = _cfg(pp, schedule, virtual_stages, n_micro)
    dims = dims_for(pp=pp)
    chunks, micro_loss, pipe = _pipeline(cfg, dims)
    x, y = _batch(n_micro)
    pipe.forward_backward(x, y)
    pipe.receive.reset_peak()
    pipe.forward_backward(x, y)
    micro_loss.pop_mean()
    return pipe.receive.peak_bytes, pipe.receive.live_bytes, _stock_receive_bytes(chunks, cfg, dims, x, y)


@pytest.mark.parametrize("schedule,pp,virtual_stages,n_micro",
                         [("1f1b", 4, 1, 16), ("gpipe", 2, 1, 6), ("interleaved_1f1b", 4, 2, 8),
                          ("zbv", 2, 2, 6), ("dualpipev", 2, 2, 6), ("zb1p", 2, 2, 6)])
def test_receive_buffers_are_held_for_the_micro_batches_in_flight_only(schedule, pp, virtual_stages, n_micro):
    """1F1B: stage s holds an input buffer for each of its min(m, pp - s) micro-batches in
    flight and one output-gradient buffer during a backward; GPipe holds all m inputs;
    interleaved as counted along torch's action order. torch's stock PipelineStage holds one
    of each per micro-batch and chunk of the step."""
    torch.set_num_threads(1)
    hidden = SEQ * MICRO * TINY.dim * 4  # one fp32 hidden state
    results = run_ranks(receive_buffers, pp, pp, schedule, virtual_stages, n_micro, timeout=300)
    for stage, (peak, left, stock) in enumerate(results):
        print(f"{schedule} pp{pp} m{n_micro} stage {stage}: peak {peak:,} B, torch's stage {stock:,} B")
        if schedule in ("1f1b", "gpipe"):  # the closed form, by hand
            in_flight = n_micro if schedule == "gpipe" else min(n_micro, pp - stage)
            assert peak == hidden * ((stage > 0) * in_flight + (stage < pp - 1)), (stage, peak)
        assert peak == hidden * receive_buffers_held(schedule, pp, virtual_stages, n_micro, stage), (stage, peak)
        assert left == 0, "every receive buffer is freed by the end of the step"
        chunks = stages_of_rank(stage, pp, virtual_stages, schedule)
        last = pp * virtual_stages - 1
        if schedule in ("1f1b", "gpipe", "interleaved_1f1b"):  # torch's stage: one of each per micro-batch
            assert stock == hidden * n_micro * sum((s > 0) + (s < last) for s in chunks), (stage, stock)
        assert peak < stock or schedule == "gpipe", (stage, peak, stock)  # GPipe really holds them all
