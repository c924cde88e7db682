"""Tensor parallelism over four ranks: same per-step loss as one process, on in-process ranks
(tests/support/runs.py train_in_ranks; the entry point runs tp2 in the Slurm tests' tp2 x pp2 and
tp2 x dp2).

tp2 trains against the same reference (20 steps, relative 1e-5) in other files, each run beside
more: without sequence parallelism in tests/multirank/test_eval.py's test_val_loss_tp2_pp2_dp2 (tp2
x pp2 x dp2, its evaluations too), with it in tests/multirank/test_parity_matrix.py's
tp2-pp2-dp2-z1-sp-recompute, test_train_zero.py's ZeRO-2 case and test_hsdp.py's; a run of tp2
alone would re-prove what those prove.

The tiny model has 4 heads and 2 kv-heads, which tp=4 cannot split; tp=4 runs (and their
1-rank reference) use 8 heads and 4 kv-heads at the same width, so grouped-query attention
is exercised at every tp. The byte-level vocabulary (257) is odd: it is padded at every tp.

The in-process runs take the global batch of 16 in 2 micro-batches of 8 (tests/support/runs.py:
parity_micro_batches): every micro-batch costs ~13 collectives, and 4 gloo ranks sharing 2 cores
wait for each other on every one; 2 micro-batches still accumulate. They train TWO_LAYERS
(tests/support/runs.py): each layer's tensor-parallel collectives and its norms' gradients summed
over tp are those of any other, so a fault of either shows in two layers as in four.
"""

import pytest

from tests.support.runs import PARITY, TWO_LAYERS, assert_parity, losses_in_ranks, reference_losses

TP4 = (*TWO_LAYERS, "model.n_heads=8", "model.n_kv_heads=4")  # the model of tp=4 (above)


def _check(tmp_path, session_tmp, model, layout):
    ref = reference_losses(session_tmp, [*PARITY, *model])
    got = losses_in_ranks(tmp_path, [*PARITY, *model, "parallel=single", *layout])
    worst = assert_parity(got, ref)
    print(f"{' '.join(layout)}: worst relative loss difference {worst:.2e}")


# tp=4 without sequence parallelism: each layer and the whole model against one rank in
# tests/multirank/test_tensor_model.py (tp2 without sp trains 20 steps in test_eval.py).
@pytest.mark.slow
def test_tp4_sp_matches_single_process(tmp_path, session_tmp):
    _check(tmp_path, session_tmp, TP4, ("parallel.tp=4", "parallel.sequence_parallel=true"))
