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
bit, and reshards to one process and from there back to dp2 ep2 on the device. bf16 on dp2 ep2
with offload follows the same run without it: tests/multirank/test_offload.py's mixed-precision
case.

These runs also hold what the model's layouts without offload would re-prove (test_moe_parity.py's
docstring): dp2 ZeRO-1 the counts summed over dp with ep = 1, pp2 x dp2 ep2 the pipeline's (1F1B:
the first stage's balance losses reach the gradients through its backward, the shape inference's
forward is not counted), dp4 ep2 ZeRO-0 the norm of expert-dp groups of 2.
"""

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
    """ep = 1: the experts' state in the one offloaded ZeRO-1 shard of each rank; the counts and
    balance losses of each dp rank's own tokens summed over dp (observe/moe.py)."""
    _check(tmp_path, session_tmp, ["parallel.dp=2", "parallel.zero_stage=1"])


@pytest.mark.slow
def test_dp4_ep2_z0_offload_matches_single_process(tmp_path, session_tmp):
    """ZeRO-0: the whole of each half on the host; expert-dp groups of 2, so the norm must count
    the experts on expert-dp rank 0 of each alone (parallel/zero/flat.py: offload's and the
    device's ZeRO-0 count alike; test_moe_ep_parity.py's dp4 ep2 is ZeRO-1)."""
    _check(tmp_path, session_tmp, ["parallel.dp=4", "parallel.ep=2", "parallel.zero_stage=0"])


@pytest.mark.slow
def test_pp2_dp2_ep2_offload_matches_single_process(tmp_path, session_tmp):
    """Each pipeline stage's halves offloaded; the shared expert stays with the dense parameters.
    1F1B (parallel.pp_schedule's default): the first stage's blocks' balance losses reach the
    gradients through the stage's own backward, and torch's shape-inference forward is not
    counted (parallel/pipeline/schedule.py ``TimedStage``; ``check_metrics``' hand count)."""
    _check(tmp_path, session_tmp, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1"])


SAVE_AT = 16
EP2 = ("parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1")


def test_dp2_ep2_z1_offload_matches_single_process_and_resumes_bit_for_bit_and_reshards_to_one_rank_and_back(
        tmp_path, session_tmp):
    """dp2 ep2 ZeRO-1 offloaded (each rank's two experts' state on its host, sharded over the
    expert-dp group of one rank) runs 20 steps against the reference (``_check``), saving at
    step 16 only. Resumed there in the same layout, its losses are the uninterrupted run's bit
    for bit (the host masters, both halves' moments and the step count all came back). The
    checkpoint chain goes on through one process: without offload it resumes at 16 (every expert
    whole, the moments read from the ep ranks' host shards) and saves at 18, where dp2 ep2 on the
    device resumes (each ep rank's slices and moments cut from the whole experts) to step 20;
    each link follows the uninterrupted 1-rank reference within rel 1e-5 (a misplaced expert
    slice or its AdamW moments would move the next steps' losses by far more). Each resume trains
    at least 2 steps: the first reads the loaded parameters, the second the loaded moments and
    masters. optim.decay_steps is the 20-step run's own (max_steps - warmup), so a link that
    stops early keeps its learning rates; nothing reads a final checkpoint."""
    ref = reference_losses(session_tmp, [*PARITY, *MOE_TWO_LAYERS])
    run = ("parallel=single", "optim.decay_steps=15")
    full = _check(tmp_path / "full", session_tmp, EP2, extra=(f"checkpoint.every={SAVE_AT}",))
    saved = store.step_dir(tmp_path / "full" / "checkpoints", SAVE_AT)
    train_in_ranks(tmp_path / "resumed", [*PARITY, *MOE_TWO_LAYERS, *run, *EP2, OFFLOAD, SMALL_BUCKETS,
                                          f"train.resume={saved}", f"train.max_steps={SAVE_AT + 2}"])
    rows = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in rows] == [SAVE_AT, SAVE_AT + 1]
    assert [r["loss"] for r in rows] == full[SAVE_AT:SAVE_AT + 2]
    # (layout, resumed from, its first step, steps to, saves at, the layout change it reports)
    chain = [((), saved, SAVE_AT, 19, 18, "ep 2 -> None"), (EP2, None, 18, 20, 0, "ep None -> 2")]
    previous = None
    for i, (layout, start, first, stop, every, change) in enumerate(chain):
        start = start or store.step_dir(previous, first)
        stdout = train_in_ranks(tmp_path / f"link{i}", [*PARITY, *MOE_TWO_LAYERS, *run, *layout, f"train.resume={start}",
                                                       f"train.max_steps={stop}", f"checkpoint.every={every}"])
        assert "layout changed since the checkpoint" in stdout and change in stdout, stdout[-2000:]
        rows = read_metrics(tmp_path / f"link{i}")
        assert [r["step"] for r in rows] == list(range(first, stop)) and stop - first >= 2
        got = [r["loss"] for r in rows]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref[first:stop]))
        print(f"link {i} ({change}): worst relative loss difference {worst:.1e}")
        assert worst <= 1e-5, (i, got, ref[first:stop])
        previous = tmp_path / f"link{i}" / "checkpoints"


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
