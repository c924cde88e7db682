"""Mixed-precision resume: the fp32 master weights and the fp16 loss scale come back exactly.

Each case trains 6 steps on 2 gloo ranks with the trainer itself (no launcher), one
micro-batch per rank and step, saving at step 3, then a second run resumes from that
checkpoint and trains steps 3-5. Both runs have
the same layout, so the resumed one must be bit-identical to the uninterrupted one: every
loss, every fp32 master weight, Adam moment and the loss scaler at the end. What would
differ if the checkpoint lost them: masters rebuilt from the bf16/fp16 parameters round
every weight (the losses drift from step 4 on), and a loss scale restarted at
``train.loss_scale_init`` = 2^20 skips the steps the first run had already backed off from
(the first steps overflow at that scale; the test checks they did).
"""

import numpy as np
import pytest

from tests.support.harness import dims_for, run_ranks
from tests.support.runs import read_metrics
from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.trainer import Trainer
from trainer3d.config.validate import validate

STEPS, SAVE_AT = 6, 3


def _config(run_dir: str, dtype: str, zero_stage: int, resume: str) -> Config:
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.parallel.timeout_s = 2, zero_stage, 60
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 32
    t.max_steps, t.log_every, t.dtype, t.resume, t.loss_scale_init = STEPS, 1, dtype, resume, 2.0 ** 20
    cfg.checkpoint.every, cfg.checkpoint.keep = SAVE_AT, 4
    return validate(cfg)


def _train(rank, world, run_dir, dtype, zero_stage, resume):
    """Train to STEPS; this rank's final optimizer state and loss scaler, as numpy arrays."""
    trainer = Trainer(_config(run_dir, dtype, zero_stage, resume), dims_for(dp=world))
    trainer.train()
    opt = trainer.optimizer
    state = {f"{kind} {v.name} {v.start}": t.float().numpy().copy()
             for v in opt.checkpoint_views() for kind, t in v.tensors.items()}
    scaler = {k: t.numpy().copy() for k, t in opt.scaler.persistent().items()} if opt.scaler is not None else {}
    return state, scaler, opt.step_count.item()


# fp16 (masters + loss scaler) under FSDP, whose fp32 parameters are the masters. The scaler's
# checkpoint path is the same for every stage. ZeRO-1's separate fp32 masters (bf16) coming back
# bit for bit: tests/multirank/test_offload.py's resumes across offload, whose z1-bf16 cases load
# them into the other optimizer and compare every loaded master, moment and parameter with the
# saver's (masters rebuilt from the bf16 parameters fail them: 100 % of a weight's elements).
CASES = [("fp16", 3)]


@pytest.mark.parametrize("dtype,zero_stage", CASES, ids=[f"{d}-zero{z}" for d, z in CASES])
def test_mixed_precision_resume_is_bit_identical(tmp_path, dtype, zero_stage):
    first, second = tmp_path / "uninterrupted", tmp_path / "resumed"
    full = run_ranks(_train, 2, str(first), dtype, zero_stage, "never", timeout=600)
    checkpoint = store.step_dir(first / "checkpoints", SAVE_AT)
    resumed = run_ranks(_train, 2, str(second), dtype, zero_stage, str(checkpoint), timeout=600)

    rows_full, rows_resumed = read_metrics(first), read_metrics(second)
    assert [r["step"] for r in rows_resumed] == list(range(SAVE_AT, STEPS))
    assert [r["loss"] for r in rows_resumed] == [r["loss"] for r in rows_full[SAVE_AT:]]
    if dtype == "fp16":  # the scale moved before the save, so restoring it matters
        assert any(r["skipped"] for r in rows_full[:SAVE_AT]), rows_full
        assert [r["loss_scale"] for r in rows_resumed] == [r["loss_scale"] for r in rows_full[SAVE_AT:]]
    for rank, ((state_a, scaler_a, steps_a), (state_b, scaler_b, steps_b)) in enumerate(zip(full, resumed)):
        assert steps_a == steps_b, rank
        if zero_stage < 2:  # separate fp32 masters exist (FSDP's fp32 parameters are the masters)
            assert any(key.startswith("master ") for key in state_a)
        assert state_a.keys() == state_b.keys()
        for key, value in state_a.items():
            np.testing.assert_array_equal(state_b[key], value, err_msg=f"rank {rank} {key}")
        assert scaler_a.keys() == scaler_b.keys() and all(np.array_equal(scaler_a[k], scaler_b[k]) for k in scaler_a)
