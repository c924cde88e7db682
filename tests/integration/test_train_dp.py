"""Data parallelism: same per-step loss as one process, dp=2 and dp=4, on in-process ranks doing
the entry point's work (tests/support/runs.py: train_in_ranks). The dp2 run's losses and its
progress lines (rank 0's stdout) are checked by two tests. Both train TWO_LAYERS against its
shared reference. A dp2 run of the entry point itself, of the four-layer model, is held to its
one-process reference where the launcher is under test: tests/integration/test_checkpoint_kill.py's
killed run keeps the rows of the steps before its checkpoint (metrics.py drops only those the
restart redoes), and the restart's comparison with the reference reads them."""

import pytest

from tests.support.runs import PARITY, TWO_LAYERS, assert_parity, losses_in_ranks, read_metrics, reference_losses, train_in_ranks, \
    train_losses

# The two-layer model (tests/support/runs.py TWO_LAYERS and its shared reference): a data-parallel
# fault (the gradients' all-reduce, the data's split over the replicas) shows in one layer as in four.
TRAINED = (*PARITY, *TWO_LAYERS)

# Its tests share a module fixture: one xdist worker runs them all (tests/conftest.py: xdist_scope).


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """2 data-parallel ranks, a progress line every 5 steps (metrics.jsonl still has one row per
    step): the run dir and rank 0's stdout."""
    run_dir = tmp_path_factory.mktemp("dp2") / "run"
    stdout = train_in_ranks(run_dir, [*TRAINED, "train.log_every=5", "parallel=single", "parallel.dp=2"])
    return run_dir, stdout


def test_dp2_matches_single_process(session_tmp, dp2_run):
    assert_parity(train_losses(dp2_run[0]), reference_losses(session_tmp, TRAINED))


def test_dp4_matches_single_process(tmp_path, session_tmp):
    ref = reference_losses(session_tmp, TRAINED)
    assert_parity(losses_in_ranks(tmp_path, [*TRAINED, "parallel=single", "parallel.dp=4"]), ref)


def test_run_reports_progress_and_metrics(dp2_run):
    run_dir, stdout = dp2_run
    progress = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4 and "tok/s" in progress[-1] and progress[-1].startswith("step 20/20"), stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(20))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(key in r for r in rows), key
