"""checkpoint.every=auto in a real loop: the first save measures, each save done recomputes
the interval from rank 0's measurements, and every rank saves at the step it printed."""

import contextlib
import io
import re

import pytest

from tests.support.harness import dims_for, run_ranks
from trainer3d.checkpoint import store
from trainer3d.checkpoint.interval import FIRST_SAVE, Measured
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer

STEPS = 60


def _train(rank, world, run_dir):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.timeout_s = world, 60
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 32, 1, 2, 2, 64
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 16
    t.max_steps, t.log_every, t.resume, t.eval_every = STEPS, 10, "never", 0
    cfg.checkpoint.every, cfg.checkpoint.mtbf_hours, cfg.checkpoint.keep = "auto", 1 / 3600, 100
    trainer = Trainer(validate(cfg), dims_for(dp=world))
    real, saves = trainer.checkpointer.save, []
    _in_step_units(trainer.checkpointer.auto)

    def save(steps_done, background=None):  # the step a save starts at, and the one planned for it then
        saves.append((steps_done, trainer.checkpointer.auto.next_at))
        print(f"save starts at step {steps_done}")  # in order with the plans rank 0 prints
        return real(steps_done, background)
    trainer.checkpointer.save = save
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    return {"saves": saves, "out": printed.getvalue()}


def _in_step_units(auto):
    """The measured figures scaled to the measured step: the same plans whatever the machine's
    load (a save that takes 40 steps on a busy CI host would leave one plan in 60 steps). The
    odd retunes are bound by Daly's optimum (7 steps), the even ones by the write (10 steps)."""
    real, count = auto.retune, [0]

    def retune(m, last_saved, steps_done):
        count[0] += 1
        auto.mtbf_s = 50 * m.step_s
        write = 4 if count[0] % 2 else 10
        return real(Measured(m.step_s, 0.5 * m.step_s, write * m.step_s), last_saved, steps_done)
    auto.retune = retune


def _expected_saves(out: str):
    """Where each save should start by the plans printed before it: the printed step where a plan
    came after the previous save started, else one printed interval after it (FIRST_SAVE before any)."""
    got, want, every, planned, last = [], [], FIRST_SAVE, None, 0
    for line in out.splitlines():
        plan = re.search(r"checkpoint\.every=auto: every (\d+) steps, next at step (\d+): ", line)
        start = re.match(r"save starts at step (\d+)$", line)
        if plan:
            every, planned = int(plan.group(1)), int(plan.group(2))
        elif start and int(start.group(1)) < STEPS:
            got.append(int(start.group(1)))
            want.append(planned if planned is not None and planned > last else last + every)
            last = got[-1]
    return got, want


@pytest.mark.slow
def test_auto_saves_at_the_steps_it_printed(tmp_path):
    results = run_ranks(_train, 2, str(tmp_path), timeout=300)
    assert results[0]["saves"] == results[1]["saves"]  # every rank saves at the same steps
    saves = results[0]["saves"]
    assert saves[0] == (FIRST_SAVE, FIRST_SAVE) and saves[-1][0] == STEPS  # the last: the end of training
    assert all(at == planned for at, planned in saves[:-1]), saves  # each save where it was due, not later
    plans = re.findall(r"checkpoint\.every=auto: every (\d+) steps, next at step (\d+): (.*)", results[0]["out"])
    reasons = {"Daly" if "Daly" in why else "write" if "must not wait" in why else why for _, _, why in plans}
    assert reasons == {"Daly", "write"}, plans
    assert {every for every, _, _ in plans} == {"7", "10"}, plans  # the intervals the scaled figures give
    got, want = _expected_saves(results[0]["out"])
    assert got == want and len(got) >= 3, results[0]["out"]
    # an interval's save can land on the last step: the end's save of that step is the same one
    # (Checkpointer.save waits for it), so each step is published once
    assert [s for s, _ in store.published(tmp_path / "checkpoints")] == list(dict.fromkeys(at for at, _ in saves))
