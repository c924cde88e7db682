"""Expert parallelism trains the same MoE model as one process (docs/moe.md, "Expert parallelism").

The tiny MoE of test_moe_parity.py (4 experts, all active, a shared expert, strong aux and z
losses), 20 steps, per-step losses within rel 1e-5 of the 1-rank reference and the routing
metrics checked against a hand count: every token goes to every expert, so each rank sends
tokens to every ep peer and the choice cannot flip between layouts (test_moe_parity.py's
comment: a top-k choice is discontinuous). The per-step gradient norm is held to one
process's too: it is what shows a wrong scale of the expert gradients (summed over the ep group
by the combine's backward, averaged over the expert-dp group, then 1 / ep:
parallel/expert/optimizer.py). Without the 1 / ep, dp2 ep2's norm was 3.8e-3 off at step 0,
while its loss moved only 2.7e-6 by step 4 (AdamW is nearly blind to a constant gradient scale).

One case per mechanism: expert-dp groups of 2 (dp4 ep2 ZeRO-1; ZeRO-0 offloaded in
test_moe_offload.py), an expert-dp group of 1 (tp2 x dp2 ep2), ep4 (one expert per rank) with the
ep group carved out of dp x cp, sp (tp2), the pipeline (interleaved, with recomputation; cp2 x
dp2 ep4 recomputes too). The checkpoint chain dp2 ep2 -> one process -> dp2 ep2 is
test_moe_offload.py's (its first link offloaded, its last on the device).
"""

import pytest

from tests.multirank.test_moe_parity import MOE, MOE_TWO_LAYERS, check_metrics
from tests.support.runs import PARITY, assert_parity, losses_in_ranks, read_metrics, reference_dir, reference_losses

# The interleaved case's 4 layers (a layer per stage of pp2 x 2 virtual) at half the width (dim 64,
# tests/support/runs.py's EIGHT_LAYERS and TIED): a stage's dispatch, sends and recomputation are
# the same at any width.
MOE_NARROW = (*MOE, "model.dim=64", "model.ffn_dim=192")


def _check(tmp_path, session_tmp, layout, model=MOE_TWO_LAYERS, n_layers=2):
    """``layout`` against the 1-rank run of ``model`` (the 4-layer MOE_NARROW where 4 stages need it)."""
    ref = reference_losses(session_tmp, [*PARITY, *model])
    got = losses_in_ranks(tmp_path, [*PARITY, *model, "parallel=single", *layout], timeout=900)
    print(f"{' '.join(layout)}: worst relative loss difference {assert_parity(got, ref):.1e}")
    rows, ref_rows = read_metrics(tmp_path), read_metrics(reference_dir(session_tmp, [*PARITY, *model]))
    check_metrics(rows, ref_rows, n_layers)
    # The global gradient norm counts every expert element once (its expert-dp owner, tp rank 0):
    # a slice counted twice or not at all moves it; above optim.grad_clip=1 it also scales the step.
    for row, ref_row in zip(rows, ref_rows):
        assert abs(row["grad_norm"] - ref_row["grad_norm"]) <= 1e-5 * ref_row["grad_norm"], (row, ref_row)


@pytest.mark.slow
def test_dp4_ep2_matches_single_process(tmp_path, session_tmp):
    """Expert-dp groups of 2: the expert gradients averaged there, ZeRO-1 shards over it (ZeRO-0,
    whose norm counts the experts on expert-dp rank 0 of each: test_moe_offload.py's dp4 ep2)."""
    _check(tmp_path, session_tmp, ["parallel.dp=4", "parallel.ep=2", "parallel.zero_stage=1"])


@pytest.mark.slow
def test_tp2_dp2_ep2_sp_matches_single_process(tmp_path, session_tmp):
    """Sequence parallelism: each tp rank dispatches its sequence shard's tokens in its own ep
    group; the expert gradients are summed over tp after the expert-dp reduction."""
    _check(tmp_path, session_tmp, ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1",
                                   "parallel.sequence_parallel=true"])


@pytest.mark.slow
def test_cp2_dp2_ep4_with_recompute_matches_single_process(tmp_path, session_tmp):
    """ep groups carved out of dp x cp: the 4 ranks of a dp2 x cp2 one ep group, one expert per
    rank, each cp pair holding the two halves of a sequence's tokens and dispatching them over all
    four ranks' experts (counts summed over cp, the balance losses' gradient started cp times
    larger: parallel/expert/tokens.py). Activation checkpointing re-runs the ring exchange, the
    dispatch and the counts' all-reduce over cp in backward, counted once
    (test_moe_layouts.py's cp2 ring case with recomputation, which this run holds)."""
    _check(tmp_path, session_tmp, ["parallel.cp=2", "parallel.dp=2", "parallel.ep=4", "parallel.zero_stage=1",
                                   "train.activation_checkpointing=true"])


@pytest.mark.slow
def test_interleaved_pp2_dp2_ep2_with_recompute_matches_single_process(tmp_path, session_tmp):
    """Two virtual stages a rank, each with its own copy of the MoE blocks (parallel/pipeline/
    stages.py deep-copies the model), dispatching over the stage's ep pair, the shared expert
    (MOE has one) with the dense parameters; the expert gradients scaled by 1 / ep on each stage
    apart; activation
    checkpointing re-runs each block's forward, dispatch included, in backward, so the all-to-alls
    run again there and a block's counts and balance loss must be recorded once, not twice."""
    _check(tmp_path, session_tmp, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
                                   "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1",
                                   "train.activation_checkpointing=true"], model=MOE_NARROW, n_layers=4)
