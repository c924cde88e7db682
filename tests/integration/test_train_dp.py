"""Data parallelism: same per-step loss as one process. dp=2 runs through the real entry point
(one run: its losses and its progress lines are checked by two tests), dp=4 on in-process
ranks (tests/support/runs.py: train_in_ranks)."""

import pytest

from tests.support.runs import (PARITY, assert_parity, losses_in_ranks, read_metrics, reference_losses, run_train,
                        train_losses)

# Its tests share a module fixture: one xdist worker runs them all (tests/conftest.py: xdist_scope).


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """``python -m trainer3d.train`` on 2 data-parallel ranks, a progress line every 5 steps
    (metrics.jsonl still has one row per step)."""
    run_dir = tmp_path_factory.mktemp("dp2") / "run"
    proc = run_train(run_dir, [*PARITY, "train.log_every=5", "parallel=single", "parallel.dp=2"])
    return run_dir, proc


def test_dp2_matches_single_process(session_tmp, dp2_run):
    assert_parity(train_losses(dp2_run[0]), reference_losses(session_tmp, PARITY))


def test_dp4_matches_single_process(tmp_path, session_tmp):
    ref = reference_losses(session_tmp, PARITY)
    assert_parity(losses_in_ranks(tmp_path, [*PARITY, "parallel=single", "parallel.dp=4"]), ref)


def test_run_reports_progress_and_metrics(dp2_run):
    run_dir, proc = dp2_run
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4 and "tok/s" in progress[-1] and progress[-1].startswith("step 20/20")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(20))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(key in r for r in rows), key
