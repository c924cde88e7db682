"""ZeRO-Offload with mixture-of-experts blocks (parallel.offload_optimizer, docs/moe.md).

With ep = 1 the experts are ordinary parameters of the one flat buffer (parallel/zero/offload.py);
with ep > 1 both halves of parallel/expert/optimizer.py are offloaded: the dense parameters'
state over dp x cp and the expert slices' over the expert-dp group, each on the host and
stepped by the same host AdamW kernel, the experts' gradients scaled by 1 / ep before they
leave for the host, and one clip divisor from one global norm.

The tiny MoE of test_moe_parity.py with 2 layers (every expert active, so the top-k choice
cannot flip between layouts; one layer per stage at pp2), 20 steps, per-step losses within rel 1e-5 of the 1-rank run without
offload, and the per-step gradient norm too (a wrong expert scale moves the norm at once, the
loss hardly: test_moe_ep_parity.py). The offloaded ep2 ZeRO-1 run's checkpoint resumes bit for
bit and reshards to one process.
"""

import numpy as np
import pytest

from tests.multirank.test_moe_parity import MOE_TWO_LAYERS, check_metrics
from tests.support.harness import run_ranks
from tests.support.runs import (PARITY, assert_parity, losses_in_ranks, read_metrics, reference_dir, reference_losses,
                                train_in_ranks)
from trainer3d.checkpoint import store

OFFLOAD = "parallel.offload_optimizer=true"
SMALL_BUCKETS = "parallel.bucket_mb=0.05"  # several buckets per half: most copies leave during backward


def _check(tmp_path, session_tmp, layout, extra=()):
    """The offloaded run of ``layout`` against the 1-rank reference: per-step losses, the experts'
    token counts and aux loss, and the per-step gradient norm; its losses."""
    ref = reference_losses(session_tmp, [*PARITY, *MOE_TWO_LAYERS])
    got = losses_in_ranks(tmp_path, [*PARITY, *MOE_TWO_LAYERS, "parallel=single", *layout, OFFLOAD, SMALL_BUCKETS, *extra],
                          timeout=900)
    print(f"{' '.join(layout)} offloaded: worst relative loss difference {assert_parity(got, ref):.1e}")
    rows, ref_rows = read_metrics(tmp_path), read_metrics(reference_dir(session_tmp, [*PARITY, *MOE_TWO_LAYERS]))
    check_metrics(rows, ref_rows, n_layers=2)
    worst = max(abs(r["grad_norm"] - q["grad_norm"]) / q["grad_norm"] for r, q in zip(rows, ref_rows))
    print(f"worst relative grad-norm difference {worst:.1e}")
    assert worst <= 1e-5
    return got


@pytest.mark.slow
def test_dp2_z1_offload_matches_single_process(tmp_path, session_tmp):
    """ep = 1: the experts' state in the one offloaded ZeRO-1 shard of each rank."""
    _check(tmp_path, session_tmp, ["parallel.dp=2", "parallel.zero_stage=1"])


@pytest.mark.slow
def test_dp2_ep2_z0_offload_matches_single_process(tmp_path, session_tmp):
    """ZeRO-0: the whole of each half on the host; the norm counts the experts on expert-dp rank 0."""
    _check(tmp_path, session_tmp, ["parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=0"])


@pytest.mark.slow
def test_pp2_dp2_ep2_offload_matches_single_process(tmp_path, session_tmp):
    """Each pipeline stage's halves offloaded; the shared expert stays with the dense parameters."""
    _check(tmp_path, session_tmp, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1"])


@pytest.mark.slow
def test_bf16_ep2_offload_follows_the_device_step(tmp_path):
    """bf16 dp2 ep2 ZeRO-1 with and without offload: the same arithmetic (the host divides by the
    clip coefficient where the device multiplies), so the losses stay within bf16's rounding.
    One micro-batch of 8 per rank: the host step runs once a step whatever the step accumulated
    (the fp32 cases above accumulate two)."""
    base = [*PARITY, *MOE_TWO_LAYERS, "parallel=single", "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1",
            "train.dtype=bf16", "train.max_steps=12", "train.micro_batch_size=8", "checkpoint.save_final=false",
            SMALL_BUCKETS]
    plain = losses_in_ranks(tmp_path / "plain", base)
    offloaded = losses_in_ranks(tmp_path / "offload", [*base, OFFLOAD])
    np.testing.assert_allclose(offloaded, plain, rtol=1e-3)
    assert offloaded[-1] < offloaded[0] - 1.0


RESUME_AT = 18
EP2 = ["parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1"]


def test_dp2_ep2_z1_offload_matches_single_process_and_resumes_bit_for_bit_and_reshards_to_one_rank(
        tmp_path, session_tmp):
    """dp2 ep2 ZeRO-1 offloaded (each rank's two experts' state on its host, sharded over the
    expert-dp group of one rank) runs 20 steps against the reference (``_check``), saving at
    step 18 only. Resumed there in the same layout, its losses are the uninterrupted run's bit
    for bit (the host masters, both halves' moments and the step count all came back); one
    process without offload resumed there too (every expert whole, the moments read from the ep
    ranks' host shards) follows the 1-rank reference within rel 1e-5. Each resume trains the
    last 2 steps: the first reads the loaded parameters, the second the loaded moments and
    masters; nothing reads a final checkpoint."""
    no_final = "checkpoint.save_final=false"
    full = _check(tmp_path / "full", session_tmp, EP2, extra=(f"checkpoint.every={RESUME_AT}",))
    saved = store.step_dir(tmp_path / "full" / "checkpoints", RESUME_AT)
    train_in_ranks(tmp_path / "resumed", [*PARITY, *MOE_TWO_LAYERS, "parallel=single", *EP2, OFFLOAD, SMALL_BUCKETS, no_final,
                                          f"train.resume={saved}"])
    rows = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in rows] == list(range(RESUME_AT, 20))
    assert [r["loss"] for r in rows] == full[RESUME_AT:]
    stdout = train_in_ranks(tmp_path / "one", [*PARITY, *MOE_TWO_LAYERS, "parallel=single", no_final, f"train.resume={saved}"])
    assert "layout changed since the checkpoint" in stdout
    one = [r["loss"] for r in read_metrics(tmp_path / "one")]
    ref = reference_losses(session_tmp, [*PARITY, *MOE_TWO_LAYERS])
    worst = max(abs(a - b) / abs(b) for a, b in zip(one, ref[RESUME_AT:]))
    print(f"resumed on one process: worst relative loss difference {worst:.1e}")
    assert len(one) == 20 - RESUME_AT and worst <= 1e-5, (one, ref[RESUME_AT:])


def _moments_after_one_step(rank, world):
    """dp2 ep2 ZeRO-1 fp32 on the memory tests' model, one step with and without offload from the
    same batch: each rank's AdamW first moments by checkpoint key (exp_avg = (1 - beta1) g)."""
    from types import SimpleNamespace

    import torch

    from tests.support.harness import dims_for
    from tests.support.moe_memory_ranks import moe_config
    from trainer3d.parallel.expert.tokens import apply_moe_layout
    from trainer3d.parallel.parallelize import build_loss_fn, build_model_chunks, build_optimizer
    from trainer3d.trainer import MicroBatchLoss, Trainer

    out = []
    for offload in (False, True):
        cfg = moe_config(dp=2, ep=2, top_k=4, offload=offload)
        dims = dims_for(dp=2, ep=2)
        chunks = build_model_chunks(cfg, dims)
        apply_moe_layout(chunks, cfg, dims)
        opt = build_optimizer(chunks, cfg, dims)
        trainer = SimpleNamespace(pipeline=None, chunks=chunks, segments=None,
                                  micro_loss=MicroBatchLoss(build_loss_fn(cfg, dims, chunks), 2, opt))
        rows = torch.randint(0, cfg.model.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(rank))
        opt.zero_grad()
        Trainer.forward_backward(trainer, rows[..., :-1], rows[..., 1:])
        opt.reduce_gradients()
        opt.clip_grad_norm(0.0)
        opt.step(1e-3)
        out.append({f"{v.name} {v.start}": v.tensors["exp_avg"].clone() for v in opt.checkpoint_views()
                    if "exp_avg" in v.tensors})
    return out


def test_offloaded_expert_gradients_carry_the_1_over_ep_scale():
    """The host steps read the experts' gradients scaled by 1 / ep (each bucket is scaled as its
    reduction is launched, before its copy leaves): after one step the offloaded first moments
    equal the device step's, experts and dense alike (a copy taken before the scale makes the
    experts' twice as large; the loss would hardly show it, AdamW being nearly scale-blind)."""
    import torch

    for rank, (plain, offloaded) in enumerate(run_ranks(_moments_after_one_step, 2, timeout=600)):
        assert plain.keys() == offloaded.keys() and any(".experts." in k for k in plain), rank
        for key, value in plain.items():
            torch.testing.assert_close(offloaded[key], value, rtol=1e-6, atol=0, msg=f"rank {rank} {key}")
