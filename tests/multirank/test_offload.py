"""ZeRO-Offload (parallel.offload_optimizer: parallel/zero/offload.py for ZeRO 0/1,
parallel/zero/fsdp_offload.py for ZeRO 2/3) trains the model one process trains, and its
checkpoints are the ones training without it writes.

fp32: pp2 x dp2 with tied embeddings (whose two copies' gradients are summed after they left
for the host), tp2 x dp2 (sequence parallel, whose norms' gradients change so too)
and one rank (ZeRO-0) with offload match the 1-rank reference per step (relative 1e-5, 20
steps, tests/support/runs.py: PARITY); so does ZeRO-2 on tp2 x dp2 (FSDP2 over the tp slices,
sequence parallel) with its shards on the host. bf16 (an MoE on dp2 ep2: both
halves of parallel/expert/optimizer.py offloaded) and fp16 with offload follow the same run
without it (fp16 ZeRO-3: ZeRO-1's; the step's arithmetic is the same, so well inside bf16's
tolerance); fp16 skips the same overflowing steps. A checkpoint saved with offload resumes
without it and the reverse, ZeRO-1 and ZeRO-3 alike.
"""

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from tests.multirank.test_moe_parity import MOE
from tests.support.harness import dims_for, run_ranks
from tests.support.runs import (PARITY, TIED, TWO_LAYERS, assert_parity, losses_in_ranks, once_per_session, read_metrics,
                                reference_losses)
from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.parallel.zero.fsdp_offload import OffloadedFSDPOptimizer
from trainer3d.parallel.zero.offload import OffloadedOptimizer
from trainer3d.trainer import Trainer

OFFLOAD = "parallel.offload_optimizer=true"
SMALL_BUCKETS = "parallel.bucket_mb=0.05"  # dozens of buckets: most copies leave during backward

# The untied layouts train TWO_LAYERS (tests/support/runs.py: each layer's buckets and collectives
# as four layers' would be, at about half the CPU); the tied one tests/support/runs.py's TIED, whose
# reference test_parity_matrix.py's tied cases share.
LAYOUTS = [
    pytest.param(TWO_LAYERS, ("parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=1",
                              "parallel.sequence_parallel=true"), id="tp2-dp2-z1-sp"),
    # each stage's buckets leaving during its backward, and the embedding's two copies (first and
    # last stage) summed after their gradients left: pp's one case, tied, as an untied run has
    # nothing of its own for offload to get wrong
    pytest.param(TIED, ("parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=1", SMALL_BUCKETS),
                 id="pp2-dp2-z1-tied"),
    # stage 0 on one rank: the whole state offloaded, every bucket's copy all of it
    pytest.param(TWO_LAYERS, ("parallel.zero_stage=0", SMALL_BUCKETS), id="single-z0"),
    # FSDP2's CPUOffloadPolicy: parameter, gradient and optimizer shards on the host. ZeRO-2 and
    # ZeRO-3 offloaded run one optimizer (parallel/zero/fsdp_offload.py) and differ only in FSDP's
    # reshard_after_forward (parallel/zero/fsdp.py), which ZeRO-3 without offload holds to the
    # reference (test_document_mask_parity.py's dp2-z3, test_context_parity.py); ZeRO-3 with
    # offload trains in the fp16 case below and the z3 checkpoint chains.
    pytest.param(TWO_LAYERS, ("parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=2",
                              "parallel.sequence_parallel=true"), id="tp2-dp2-z2-sp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", LAYOUTS)
def test_offload_matches_single_process(tmp_path, session_tmp, model, layout):
    ref = reference_losses(session_tmp, [*PARITY, *model])
    got = losses_in_ranks(tmp_path, [*PARITY, *model, "parallel=single", *layout, OFFLOAD], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")


# Steps of 8 sequences x 32 tokens, one micro-batch per rank (the host step's arithmetic runs
# once a step whatever the step accumulated; the fp32 layouts above accumulate two). The host
# step is the same for bf16 and fp16 but for fp16's loss scale and skip flag, which each stage
# carries its own way (parallel/zero/offload.py, fsdp_offload.py): fp16 on ZeRO-1 and ZeRO-3, bf16
# on ZeRO-1. fp16 trains the 4-layer model at half its width (tests/support/runs.py TIED's dim and
# ffn_dim) for 10 steps: from a loss scale of 2^17 it skips its first step and step 7, with two
# clean steps after it whose losses show a host step that was not skipped, and the loss still
# falls by more than 1 (with 2 layers only the first step overflowed). bf16 trains
# test_moe_parity.py's MoE with 2 layers on dp2 ep2 for 8 steps (fp16 with ep > 1 is refused:
# config/validate_moe.py), whose two offloaded halves (the dense parameters over dp, the expert
# slices over their expert-dp group: parallel/expert/optimizer.py) each keep fp32 masters on the
# host; a host step that kept none moved the losses by far more than rtol 1e-3 (commit message).
LOSS_SCALE_INIT = 2 ** 17
MIXED = ("train.log_every=1", "train.seq_len=32", "train.micro_batch_size=4",
         "train.global_batch_size=8", "train.grad_accum_steps=null", "optim.warmup_steps=5", "parallel.timeout_s=60",
         "parallel=single", "parallel.dp=2", "checkpoint.save_final=false", SMALL_BUCKETS)
FP16 = ("model.dim=64", "model.ffn_dim=192", "train.max_steps=10")
MOE_EP2 = (*MOE, *TWO_LAYERS, "optim.lr=3e-3", "parallel.ep=2", "train.max_steps=8")


def _device_rows(session_tmp, overrides):
    """The metrics of the run of ``overrides`` without offload, made once per session
    (tests/support/runs.py ``once_per_session``): fp16's ZeRO-1 run is the one both fp16 stages
    with offload follow (ZeRO-3's device step is ZeRO-1's arithmetic: the same fp32 masters, fp16
    compute and loss scaler: ZeRO-3's offloaded run skips the steps ZeRO-1's skips, at the same
    scales, its losses well inside rtol 1e-3 of them; figures in the commit message)."""
    run = Path(session_tmp) / f"offload-device-{hashlib.sha256(chr(0).join(overrides).encode()).hexdigest()[:16]}"
    with once_per_session(session_tmp, run.name) as todo:
        if todo:
            losses_in_ranks(run, overrides)
    return read_metrics(run)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs, each bounded by losses_in_ranks (900 s); pyproject's 600 s cut them short
@pytest.mark.parametrize("dtype,stage,model", [("bf16", 1, MOE_EP2), ("fp16", 1, FP16), ("fp16", 3, FP16)],
                         ids=["bf16-1-moe-ep2", "fp16-1", "fp16-3"])
def test_mixed_precision_offload_follows_the_device_step(tmp_path, session_tmp, dtype, stage, model):
    """The same run with and without offload (fp16 ZeRO-3's: ZeRO-1's without, ``_device_rows``):
    per-step losses within bf16's rounding of one another (they differ only in dividing vs
    multiplying by the clip coefficient), and fp16's loss scale and skipped steps identical (2^17
    to start: the first step overflows)."""
    base = [*MIXED, *model, f"train.dtype={dtype}", f"train.loss_scale_init={LOSS_SCALE_INIT}"]
    rows_plain = _device_rows(session_tmp, [*base, "parallel.zero_stage=1"])
    offloaded = losses_in_ranks(tmp_path / "offload", [*base, f"parallel.zero_stage={stage}", OFFLOAD])
    plain = [r["loss"] for r in rows_plain]
    print(f"worst relative loss difference {max(abs(a - b) / b for a, b in zip(offloaded, plain)):.1e}")
    np.testing.assert_allclose(offloaded, plain, rtol=1e-3)
    assert offloaded[-1] < offloaded[0] - 1.0
    if dtype == "fp16":
        rows_off = read_metrics(tmp_path / "offload")
        assert rows_off[0]["skipped"] and any(r["skipped"] for r in rows_off[1:-2]), [r["skipped"] for r in rows_off]
        assert not all(r["skipped"] for r in rows_off)
        for key in ("skipped", "loss_scale"):
            assert [r[key] for r in rows_off] == [r[key] for r in rows_plain], key


# One micro-batch per rank and step: a resume restores state, whatever a step accumulates. A
# chain of runs on the same ranks, each link in the other mode (offload or not) than the one
# before: link 0 trains from the start and keeps its save at step 1 (moments and masters moved off
# their initial values); link i resumes there, trains to STEPS and keeps its save at step i + 1
# for link i + 1 (the last link saves nothing). A resumed link's first step reads the loaded
# parameters, its second (where it has one) the loaded moments and masters; the saves
# checkpoint.every makes at other steps are passed over, as nothing reads them.
STEPS = 3


def _config(run_dir: str, dtype: str, offload: bool, resume: str, stage: int, save_at) -> Config:
    """A link that keeps a save (``save_at``) saves every step (``_train`` keeps the one at ``save_at``)."""
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.parallel.timeout_s = 2, stage, 60
    cfg.parallel.offload_optimizer = offload
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 32
    t.max_steps, t.log_every, t.dtype, t.resume = STEPS, 1, dtype, resume
    cfg.checkpoint.every, cfg.checkpoint.save_final = (1 if save_at else 0), False
    return validate(cfg)


def _state(opt):
    return {f"{kind} {v.name} {v.start}": t.float().numpy().copy()
            for v in opt.checkpoint_views() for kind, t in v.tensors.items()}


def _train(run_dir, dtype, offload, resume, stage, world, save_at):
    """Train to STEPS; this rank's state by checkpoint key as built (or loaded), and as the save at
    ``save_at`` left it (the save's own state: taken once the save has copied it)."""
    trainer = Trainer(_config(run_dir, dtype, offload, resume, stage, save_at), dims_for(dp=world))
    kind = OffloadedOptimizer if stage < 2 else OffloadedFSDPOptimizer
    assert isinstance(trainer.optimizer, kind) == offload
    loaded, saved, save = _state(trainer.optimizer), {}, trainer.save_checkpoint

    def save_and_keep(step, background=None):
        if step == save_at:
            save(step, background)
            saved[step] = _state(trainer.optimizer)
    trainer.save_checkpoint = save_and_keep
    trainer.train()
    return loaded, saved


def _chain(rank, world, root, dtype, modes, stage):
    """The links of ``modes`` (offload or not, each), on the same ranks: link i resumes from link
    i - 1's save at step i."""
    links, resume = [], "never"
    for i, offload in enumerate(modes):
        save_at = i + 1 if i + 1 < len(modes) else None
        links.append(_train(f"{root}/link{i}", dtype, offload, resume, stage, world, save_at))
        dist.barrier()  # the save published before any rank reads it
        resume = str(store.step_dir(f"{root}/link{i}/checkpoints", i + 1))
    return links


# Both directions where a stage and dtype load differently: ZeRO-1 bf16 (the masters saved and
# loaded as state), ZeRO-3 fp32 (the shards loaded where they live, host or device); one direction
# for ZeRO-3 bf16. ZeRO-1 fp32 (the host masters taken from the loaded parameters, the same
# ``after_load`` whichever mode saved) resumes bit for bit in tests/multirank/test_moe_offload.py's
# offloaded dp2 ep2 run; a device save loads into an offloaded ZeRO-1 under the same keys in the
# bf16 chain's last link.
CHAINS = [(1, "bf16", (True, False, True)), (3, "fp32", (True, False, True)), (3, "bf16", (True, False))]


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype,modes", CHAINS,
                         ids=["z1-bf16-offload-device-offload", "z3-fp32-offload-device-offload",
                              "z3-bf16-offload-to-device"])
def test_checkpoint_resumes_across_offload(tmp_path, stage, dtype, modes):
    """dp2 trained by one mode, saving after a step, and resumed there by the other (and, in a
    three-link chain, saved again and resumed in the first mode): the loaded parameters, fp32
    masters (ZeRO-1 bf16; under FSDP the fp32 parameter shards are the masters) and moments are
    bit for bit what the saver held, under the same keys, and the resumed steps follow the
    saver's own (ZeRO-3: the shards are loaded where they live, host or device)."""
    results = run_ranks(_chain, 2, str(tmp_path), dtype, modes, stage, timeout=600)
    for rank, links in enumerate(results):
        assert links[-1][1] == {}, rank
        for i in range(1, len(links)):
            (_, saves), (loaded, _) = links[i - 1], links[i]
            assert list(saves) == [i], (rank, i)
            at_save = saves[i]
            assert at_save.keys() == loaded.keys(), (rank, i)
            assert any(k.startswith("master ") for k in loaded) == (dtype == "bf16" and stage == 1), (rank, i)
            for key, value in at_save.items():
                np.testing.assert_array_equal(loaded[key], value, err_msg=f"rank {rank} link {i} {key}")
    for i in range(1, len(modes)):
        saver = {r["step"]: r["loss"] for r in read_metrics(tmp_path / f"link{i - 1}")}
        rows = read_metrics(tmp_path / f"link{i}")
        assert [r["step"] for r in rows] == list(range(i, STEPS))
        np.testing.assert_allclose([r["loss"] for r in rows], [saver[r["step"]] for r in rows],
                                   rtol=1e-3 if dtype == "bf16" else 1e-5, err_msg=f"link {i}")
