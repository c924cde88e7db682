"""Data parallelism through the real entry point: same per-step loss as one process."""

import pytest

from tests.runs import PARITY, assert_parity, losses, read_metrics, reference_losses, run_train


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_single_process(tmp_path, session_tmp, dp):
    ref = reference_losses(session_tmp, PARITY)
    got = losses(tmp_path, [*PARITY, "parallel=single", f"parallel.dp={dp}"])
    assert_parity(got, ref)


def test_run_reports_progress_and_metrics(tmp_path):
    proc = run_train(tmp_path, [*PARITY, "train.log_every=5", "parallel=single", "parallel.dp=2"])
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4 and "tok/s" in progress[-1] and progress[-1].startswith("step 20/20")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(20))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(key in r for r in rows), key
