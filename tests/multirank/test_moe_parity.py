"""A mixture-of-experts model trains the same in every layout it runs in as in one process.

A tiny MoE (4 experts, all active, a shared expert, the aux and z losses weighted strongly
enough that a wrong scale of their gradient shows in the loss) on 2 gloo ranks for 20 steps against
the 1-rank reference (tests/support/runs.py: PARITY): per-step losses within relative 1e-5.
The routing metrics are the global batch's: each step's counts of every layer add up to
tokens x top_k (a hand count), the balance loss is 1 (by hand, below) and one process's.

This file holds tp2 without sequence parallelism, the one layout no other run of this model
trains, and the model and ``check_metrics`` the MoE parity files share. The others hold this
model's remaining layouts, each one run proving what a run of its own here did: dp (the counts
summed over dp, the experts reduced with the dense gradients) in test_moe_offload.py's dp2
ZeRO-1; tp with sequence parallelism (the router's and experts' gradients and the counts summed
over tp) in test_moe_ep_parity.py's tp2 x dp2 ep2; the pipeline (the first stage's balance
losses, the shape inference not counted) in test_moe_offload.py's pp2 x dp2 ep2 1F1B and
test_moe_ep_parity.py's interleaved pp2.
"""

from tests.support.runs import (PARITY, TWO_LAYERS, assert_parity, losses_in_ranks, read_metrics, reference_dir,
                                reference_losses)

# Every token goes to all 4 experts (top_k = num_experts), so the routing is continuous in the
# router's logits: the sorting, counts, grouped matmuls, gates, aux and z losses are all
# exercised, but no layout's 1e-7 reduction-order difference can switch a token's experts.
# With top-2 of 4 one can: measured at lr 1e-3 over 20 steps, dp2 ZeRO-1 and tp2 with sp stayed
# within 1.3e-7, while dp2 ZeRO-0 and tp2 without sp matched to 1e-7 through step 8 and then
# jumped 3e-6 at step 9 (one near-tie decided the other way), 7.6e-5 by step 19: a top-k choice
# is discontinuous, and no reduction order avoids that (docs/moe.md).
MOE = ("model.moe.num_experts=4", "model.moe.top_k=4", "model.moe.expert_ffn_dim=64",
       "model.moe.num_shared_experts=1", "model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=0.01",
       "optim.lr=1e-3")
# Layouts of at most two pipeline stages train it with 2 layers (tests/support/runs.py: TWO_LAYERS).
MOE_TWO_LAYERS = (*MOE, *TWO_LAYERS)
ROUTED_PER_STEP = 16 * 64 * 4  # global batch x seq_len x top_k (PARITY)


def check_metrics(rows, ref_rows, n_layers):
    layers = sorted({key.split("/")[1] for key in rows[0] if key.startswith("moe_tokens/")})
    assert layers == [f"L{i}" for i in range(n_layers)]
    for row in rows:
        for layer in layers:
            assert sum(row[f"moe_tokens/{layer}/E{e}"] for e in range(4)) == ROUTED_PER_STEP
        # every expert takes every token: the load is even and Switch's loss is E * sum_i (1/E) P_i = 1
        assert row["moe_max_load"] == 1.0 and abs(row["moe_aux_loss"] - 1.0) < 1e-6
    for row, ref in zip(rows, ref_rows):
        assert abs(row["moe_aux_loss"] - ref["moe_aux_loss"]) <= 1e-5 * ref["moe_aux_loss"]


def test_moe_tensor_parallel_matches_single_process(tmp_path, session_tmp):
    """Experts whole on each tp rank, every tp rank computing all the tokens (no sequence
    parallelism: nothing summed over tp, the counts taken from tp rank 0 alone)."""
    ref = reference_losses(session_tmp, [*PARITY, *MOE_TWO_LAYERS])
    got = losses_in_ranks(tmp_path, [*PARITY, *MOE_TWO_LAYERS, "parallel=single", "parallel.tp=2"], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
    check_metrics(read_metrics(tmp_path), read_metrics(reference_dir(session_tmp, [*PARITY, *MOE_TWO_LAYERS])), 2)
