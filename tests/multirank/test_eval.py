"""Held-out evaluation: the same validation loss in every layout (the reference and the layouts
on in-process ranks: tests/support/runs.py train_in_ranks; the entry point evaluates in
tests/integration/test_metrics.py).

The PARITY runs (20 steps, fp32) evaluate 2 global batches of the built-in corpus's held-out
tail (conf/data/stdlib.yaml: data.val_fraction) after steps 10 and 20. Each layout's
val_loss must equal the single process's (relative 1e-5), and its training losses must
equal those of the same run without evaluation: the forward-only passes leave the model,
its gradients and the optimizer untouched. The tp2 x pp2 x dp2 run is also the parity
matrix's default-layout row (tests/multirank/test_parity_matrix.py): one run, both checks. Every
layout trains TWO_LAYERS (tests/support/runs.py), one reference with evaluations for all; the
pipeline's forward-only pass over more stages, and with the interleaved schedule, evaluates in
tests/multirank/test_eval_partial.py against a hand computation (1F1B on pp4 trains 20 steps in
tests/multirank/test_train_pp.py).
"""

import math

import pytest

from tests.support.runs import PARITY, REL_TOL, TWO_LAYERS, assert_parity, read_metrics, reference_losses, train_in_ranks

# Its tests share a module fixture: one xdist worker runs them all (tests/conftest.py: xdist_scope).

EVAL = ("train.eval_every=10", "train.eval_steps=2")


def _reference(tmp_path_factory, model):
    run = tmp_path_factory.mktemp("eval-reference")
    train_in_ranks(run, [*PARITY, *model, *EVAL, "parallel=single"])
    return read_metrics(run)


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory):
    """The 1-rank run with evaluations of TWO_LAYERS (every layout's here)."""
    return _reference(tmp_path_factory, TWO_LAYERS)


def val_losses(rows):
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def check_layout(tmp_path, reference, layout, model=()):
    stdout = train_in_ranks(tmp_path, [*PARITY, *model, *EVAL, "parallel=single", *layout])
    rows = read_metrics(tmp_path)
    got, want = val_losses(rows), val_losses(reference)
    assert sorted(got) == sorted(want) == [9, 19]
    for step in want:
        assert abs(got[step] - want[step]) / want[step] <= REL_TOL, (step, got[step], want[step])
        row = next(r for r in rows if r["step"] == step)
        assert math.isclose(row["val_ppl"], math.exp(row["val_loss"]), rel_tol=1e-9)
    assert want[19] < want[9], "the validation loss falls as the model trains"
    assert "val_loss" in stdout, "the progress line shows it"
    print(f"val_loss {got}, worst train-loss difference "
          f"{assert_parity([r['loss'] for r in rows], [r['loss'] for r in reference]):.1e}")


def test_evaluation_leaves_training_untouched(reference_two, session_tmp):
    assert [r["loss"] for r in reference_two] == reference_losses(session_tmp, [*PARITY, *TWO_LAYERS])


def test_val_loss_tp2_pp2_dp2(tmp_path, reference_two):
    """ZeRO-0 over dp2 in several gradient buckets a rank (bucket_mb 0.05: ~13k fp32 elements each), the
    20-step parity of tests/multirank/test_train_zero.py's ZeRO-0 row, and tp2 without sequence
    parallelism (tests/multirank/test_train_tp.py's docstring)."""
    check_layout(tmp_path, reference_two, ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.bucket_mb=0.05"],
                 TWO_LAYERS)


@pytest.mark.slow
def test_val_loss_dp2_zero3_offloaded(tmp_path, reference_two):
    """FSDP2 with its shards on the host (parallel/zero/fsdp_offload.py) evaluates the model it trains."""
    check_layout(tmp_path, reference_two, ["parallel.dp=2", "parallel.zero_stage=3", "parallel.offload_optimizer=true"],
                 TWO_LAYERS)
