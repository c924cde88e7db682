"""Stragglers on two data-parallel ranks (docs/failures.md): the drill's slow rank is named
once its window's median has stayed high long enough, on the console and in metrics.jsonl; a clean run names nobody.

The drill's delay (train.inject.slow_ms=300) is many times the tiny model's step (a few ms
on a quiet core, tens under load), so the slow rank's compute is several times its peer's
whatever the host's load; the detector then needs the median over WINDOW = 10 steps at 1.5x,
held for PERSIST = 5 steps (the defaults, 20 and 10, would take 30 steps of 300 ms sleeps to
show the same thing).
"""

import contextlib
import io
import os

import pytest

from tests.support.harness import dims_for, run_ranks
from tests.support.runs import read_metrics
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer

STEPS, SLOW_MS, WINDOW, PERSIST = 16, 300.0, 10, 5


CLEAN_THRESHOLD = 3.0
"""The clean run's ``train.straggler.threshold``: its two ranks do equal work, but on two cores
shared with the suite's other worker one can be slower than the other for real (a whole-suite run
named rank 1 at 1.57x its peer's median compute for 14 steps at the default 1.5); a detector
naming a rank of equal work still fails at 3x, and the drill's 300 ms a step is far above it."""


def _cfg(run_dir, slow_rank):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.timeout_s = 2, 60
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 32, 1, 2, 2, 64
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 16
    t.max_steps, t.log_every, t.eval_every = STEPS, 10, 0
    t.straggler.window, t.straggler.persist = WINDOW, PERSIST
    if slow_rank is not None:
        t.inject.slow_rank, t.inject.slow_ms = slow_rank, SLOW_MS
    else:
        t.straggler.threshold = CLEAN_THRESHOLD
    cfg.checkpoint.save_final = False
    return validate(cfg)


def _train(rank, world, run_dir, slow_rank):
    os.environ["LOCAL_RANK"] = str(rank)  # as the local launcher exports it
    trainer = Trainer(_cfg(run_dir, slow_rank), dims_for(dp=world))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    return [line for line in printed.getvalue().splitlines() if "straggler" in line]


@pytest.mark.slow
def test_the_slow_rank_is_named_within_its_window_and_persistence(tmp_path):
    said = run_ranks(_train, 2, str(tmp_path), 1, timeout=300)
    assert said[1] == []  # rank 0 speaks
    assert len(said[0]) == 1, said[0]
    assert said[0][0].startswith("trainer3d: straggler: rank 1 (node "), said[0]
    span = WINDOW + PERSIST - 1  # its window filled, then PERSIST - 1 more steps above the threshold
    assert "local rank 1)" in said[0][0] and f"the median compute for {span} steps" in said[0][0]
    rows = read_metrics(tmp_path)
    named = [r["step"] for r in rows if r.get("straggler_rank") == 1]
    # its window fills at step WINDOW - 1, held PERSIST steps: named at step span - 1, and on every step after
    assert named == list(range(span - 1, STEPS)), named
    ratios = [r["straggler_ratio"] for r in rows if "straggler_ratio" in r]
    assert min(ratios) > 2, ratios  # a median over 10 steps: a step or two stalled by the host moves it little


@pytest.mark.slow
def test_a_clean_run_names_nobody(tmp_path):
    said = run_ranks(_train, 2, str(tmp_path), None, timeout=300)
    assert said == [[], []]
    rows = read_metrics(tmp_path)
    assert len(rows) == STEPS and not any("straggler_rank" in r for r in rows)
    assert all(r["rank_compute_s"] > 0 and r["slowest_rank"] in (0, 1) for r in rows)
