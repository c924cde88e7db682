"""Loss spikes on two data-parallel ranks with ZeRO-1's sharded optimizer (docs/failures.md).

A drill batch of uniformly random ids (train.inject.corrupt_steps) makes the spike; the
reference for each policy is a fresh run told the steps to skip (train.skip_steps), which
never reads those batches at all. Both must train bit-identically after the spike: the
rollback restores the state before the skipped steps exactly, and a skipped update leaves
weights, moments and the step counter as they were, on every rank alike.
"""

import contextlib
import io
import json
import os
import signal

import pytest

from tests.support.harness import dims_for, run_ranks
from tests.support.runs import read_metrics
from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer

SPIKE, STEPS = 20, 24
LR = 1e-2


def _cfg(world, run_dir, policy, skip_steps, resume="never"):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.parallel.timeout_s = world, 1, 60
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 32, 1, 2, 2, 64
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 16
    t.max_steps, t.log_every, t.resume, t.eval_every = STEPS, 1, resume, 0
    t.spike.policy, t.spike.window, t.spike.min_steps, t.spike.skip_window = policy, 10, 10, 4
    t.inject.corrupt_steps, t.skip_steps = [SPIKE], skip_steps
    cfg.optim.lr, cfg.optim.warmup_steps = LR, 0  # the loss falls well below ln(vocab) before the spike
    cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.async_save = 5, 10, False
    return validate(cfg)


def _train(rank, world, run_dir, policy, skip_steps, preempt_at=None):
    """Train; with ``preempt_at``, Slurm's warning (SIGUSR2) reaches rank 1 when it trains step
    ``preempt_at`` the second time (after the rollback), and the run is resumed from its stop."""
    trainer = Trainer(_cfg(world, run_dir, policy, skip_steps), dims_for(dp=world))
    if preempt_at is not None:
        real, visits = trainer.train_step, []

        def step(s):
            visits.append(s)
            if rank == 1 and visits.count(preempt_at) == 2:
                os.kill(os.getpid(), signal.SIGUSR2)
            return real(s)
        trainer.train_step = step
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
        stopped = trainer.stopped.step if trainer.stopped else None
        if preempt_at is not None:
            trainer = Trainer(_cfg(world, run_dir, policy, skip_steps, resume="auto"), dims_for(dp=world))
            trainer.train()
    return {"step_count": float(trainer.optimizer.step_count), "stopped": stopped, "start": trainer.start_step,
            "history": list(trainer.spikes.losses),
            "said": [s for s in printed.getvalue().splitlines() if "loss spike" in s]}


def _losses(run_dir):
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


def _replay(tmp_path, policy, skipped):
    fresh = tmp_path / "fresh"
    results = run_ranks(_train, 2, str(fresh), policy, skipped, timeout=300)
    return fresh, results


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """The uninterrupted rollback run (its directory and its ranks' results), which two tests read."""
    spiked = tmp_path_factory.mktemp("spiked")
    return spiked, run_ranks(_train, 2, str(spiked), "rollback", [], timeout=300)


@pytest.mark.slow
def test_rollback_then_a_fresh_run_told_its_skips_train_bit_identically(tmp_path, rolled_back):
    spiked, results = rolled_back
    log = json.loads((spiked / "skipped_steps.json").read_text())
    # Checkpoints every 5 steps: the newest at or before step 20 - 4 + 1 = 17 is step 15's.
    assert log["steps"] == [17, 18, 19, 20], log
    assert [e["action"] for e in log["events"]] == ["rollback to step 15, skip steps 17-20"], log
    assert results[0]["history"] == results[1]["history"]  # the same verdicts from the same agreed values
    assert "rolling back to the checkpoint of step 15" in results[0]["said"][0] and results[1]["said"] == []
    # Step 20's checkpoint (it trained on steps 17-19) set aside; the rerun saved step 20 again.
    assert [s for s, _ in store.published(spiked / "checkpoints")] == [5, 10, 15, 20, 24]
    assert [p.name for p in (spiked / "checkpoints" / "abandoned").glob("*/step_*")] == ["step_00000020"]
    rolled = _losses(spiked)
    assert sorted(rolled) == [s for s in range(STEPS) if s not in log["steps"]]  # no row doubled by the rerun

    fresh, again = _replay(tmp_path, "rollback", log["steps"])
    replayed = _losses(fresh)
    assert sorted(replayed) == sorted(rolled)
    after = [s for s in rolled if s > SPIKE]
    assert [rolled[s] for s in after] == [replayed[s] for s in after]  # bit-identical
    assert again[0]["said"] == [] and not (fresh / "skipped_steps.json").exists()
    # Momentum untouched by the skipped steps: as many AdamW steps as trained steps, on both ranks.
    assert [r["step_count"] for r in results] == [r["step_count"] for r in again] == [STEPS - 4] * 2


@pytest.mark.slow
def test_skip_leaves_the_update_out_on_every_rank(tmp_path):
    spiked = tmp_path / "spiked"
    results = run_ranks(_train, 2, str(spiked), "skip", [], timeout=300)
    log = json.loads((spiked / "skipped_steps.json").read_text())
    assert log["steps"] == [SPIKE] and log["events"][0]["action"] == "skip", log
    assert "loss" in log["events"][0]["reason"] and log["events"][0]["step"] == SPIKE
    assert [r["step_count"] for r in results] == [STEPS - 1] * 2
    assert results[0]["said"] and "its update skipped" in results[0]["said"][0]

    fresh, again = _replay(tmp_path, "skip", [SPIKE])
    got, want = _losses(spiked), _losses(fresh)
    assert sorted(want) == [s for s in range(STEPS) if s != SPIKE]
    assert [got[s] for s in sorted(want)] == [want[s] for s in sorted(want)]  # bit-identical, before and after
    assert [r["step_count"] for r in again] == [STEPS - 1] * 2


@pytest.mark.slow
def test_a_run_preempted_after_its_rollback_resumes_into_the_same_losses(tmp_path, rolled_back):
    """The stop comes inside the skipped steps (the signal during step 16's rerun, agreed one
    step later): the resumed run reads the skip log, so it neither trains a skipped batch nor
    passes over any other — every row as an uninterrupted rollback run writes it."""
    whole, cut = rolled_back[0], tmp_path / "cut"
    results = run_ranks(_train, 2, str(cut), "rollback", [], 16, timeout=300)
    assert [r["stopped"] for r in results] == [18, 18] and [r["start"] for r in results] == [18, 18], results
    assert json.loads((cut / "skipped_steps.json").read_text()) == json.loads((whole / "skipped_steps.json").read_text())
    assert _losses(cut) == _losses(whole)  # the same steps, bit-identical
    assert [r["step_count"] for r in results] == [STEPS - 4] * 2


def _warned(rank, world, run_dir, resume):
    trainer = Trainer(_cfg(world, run_dir, "warn", [], resume), dims_for(dp=world))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return {"history": list(trainer.spikes.losses), "seen": trainer.spikes.seen}


@pytest.mark.slow
def test_a_resumed_run_judges_as_the_uninterrupted_run(tmp_path):
    """The spike watch's window travels in the checkpoint: resumed at step 15 (5 steps after the
    watch armed), the run warns of step 20's spike with the same loss and the same reason (the
    median and the robust sd of the same window) as the run that never stopped. A window started
    afresh at step 15 would not be armed by step 20 (train.spike.min_steps=10)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    ran = run_ranks(_warned, 2, str(whole), "never", timeout=300)
    step15 = dict(store.published(whole / "checkpoints"))[15]
    again = run_ranks(_warned, 2, str(resumed), str(step15), timeout=300)
    events = json.loads((whole / "skipped_steps.json").read_text())["events"]
    assert [e["step"] for e in events] == [SPIKE] and events[0]["action"] == "warn", events
    assert json.loads((resumed / "skipped_steps.json").read_text())["events"] == events
    assert again == ran  # the same window at the end, bit for bit
