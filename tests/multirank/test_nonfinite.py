"""A non-finite loss stops the run (train.on_nonfinite=stop) at the next logging interval or
checkpoint, on every rank, saving nothing past it; =continue trains on as before.

Two data-parallel ranks train the tiny model; from step 3 on, rank 1's final norm outputs
NaN (as a corrupted weight or an overflow would), so only that rank's loss and gradients go
bad at first — the gradient all-reduce spreads it, and the stop must still come on both.
"""

import contextlib
import io
import math

from tests.support.harness import dims_for, run_ranks
from tests.support.runs import read_metrics
from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.observe.nonfinite import NonFiniteLoss
from trainer3d.trainer import Trainer
from trainer3d.config.validate import validate

BAD_FROM = 3


def _train(rank, world, run_dir, action, log_every):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.timeout_s = world, 60
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 8, None, 32
    t.max_steps, t.log_every, t.on_nonfinite, t.resume = 8, log_every, action, "never"
    cfg.model.n_layers, cfg.checkpoint.every, cfg.checkpoint.keep = 2, 2, 10
    trainer = Trainer(validate(cfg), dims_for(dp=world))
    calls = {"n": 0}

    def poison(module, inputs, output):
        calls["n"] += 1  # one forward per micro-batch; grad_accum micro-batches per step
        step = (calls["n"] - 1) // trainer.cfg.train.grad_accum_steps
        return output * float("nan") if rank == 1 and step >= BAD_FROM else output
    trainer.chunks[0].norm.register_forward_hook(poison)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            trainer.train()
    except NonFiniteLoss as err:
        return str(err)
    return [line for line in printed.getvalue().splitlines() if "not finite" in line]


def test_nonfinite_loss_stops_every_rank_and_saves_nothing_after_it(tmp_path):
    # Logging every 8 steps: the stop comes from the check before step 4's checkpoint.
    results = run_ranks(_train, 2, str(tmp_path), "stop", 8, timeout=300)
    assert results[0] == results[1] and isinstance(results[0], str), results
    assert f"not finite (inf/nan) at step {BAD_FROM + 1}" in results[0] and "train.on_nonfinite" in results[0]
    saved = [step for step, _ in store.published(tmp_path / "checkpoints")]
    assert saved == [2], saved  # step 4's checkpoint would hold weights trained on NaN
    assert not (tmp_path / "metrics.jsonl").exists() or all(
        math.isfinite(r["loss"]) for r in read_metrics(tmp_path) if r["step"] < BAD_FROM)


def test_continue_trains_on(tmp_path):
    results = run_ranks(_train, 2, str(tmp_path), "continue", 4, timeout=300)
    # Rank 0 warns at each check that finds new non-finite steps (the checks before the checkpoints
    # after steps 4, 6 and 8 and at the logs after 4 and 8: three find new ones); rank 1 is quiet.
    assert results[1] == [] and [line.split("from step ")[1][:2] for line in results[0]] == ["4;", "5;", "7;"], results
    assert "training goes on (train.on_nonfinite=continue)" in results[0][0]
    assert [step for step, _ in store.published(tmp_path / "checkpoints")] == [2, 4, 6, 8]
    assert math.isnan(read_metrics(tmp_path)[-1]["loss"])
