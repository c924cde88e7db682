"""The three dimensions together: every layout trains the model one process trains.

Each case trains on tp x pp x dp gloo ranks for 20 steps with the global batch, seed and data
of the 1-rank reference (tests/support/runs.py: PARITY) and compares the per-step losses (fp32,
relative 1e-5). Each does the entry point's work on in-process ranks (tests/support/runs.py:
train_in_ranks), the same engine without starting an interpreter per rank; the entry point
itself runs layouts in tests/multirank/test_train_dp.py and the Slurm tests (pp2 on one node,
tp2 x pp2 and tp2 x dp2 across two).
"""

import pytest

from tests.support.runs import EIGHT_LAYERS, PARITY, TIED, TWO_LAYERS, assert_parity, losses_in_ranks, reference_losses

# pp=4 x 2 virtual stages needs 8 layers: tests/support/runs.py's EIGHT_LAYERS, shared with test_train_pp.py.
# optim=muon: its reference is the one-process Muon run (itself held to torch.optim.Muon in
# tests/multirank/test_muon.py). Newton-Schulz in fp32: in bf16 a last-bit difference of a
# gradient flips roundings of the whole update, and no two layouts would agree to 1e-5. A
# model of 2 layers at dim 64 keeps the run and its reference short.
# Zero-bubble schedules (docs/parallelism.md): the weight step apart from the input step, through
# the ZeRO buckets' hooks (parallel/pipeline/weight_grad.py). zbv and dualpipev: 2 stages per rank in a V.
ZBV = ("parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2")
DUALPIPEV = ("parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2")
ZB1P = ("parallel.pp_schedule=zb1p",)
# A V's tied embedding: the first and the last stage on pp rank 0 share one Parameter (parallel/
# tied.py), accumulated by both stages' backwards and W steps, held once in the ZeRO buffers:
# tests/support/runs.py's TIED, shared with tests/multirank/test_offload.py's tied case.
MUON = ("optim=muon", "optim.muon.ns_dtype=fp32", "model.dim=64", "model.ffn_dim=192", "model.n_layers=2")


def case(tp, pp, dp, zero=0, model=(), extra=(), slow=True, id=None):
    layout = (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.zero_stage={zero}")
    return pytest.param(model, (*layout, *extra), id=id or f"tp{tp}-pp{pp}-dp{dp}-z{zero}",
                        marks=[pytest.mark.slow] if slow else [])


# Layouts of at most two stages train TWO_LAYERS (tests/support/runs.py), the deeper ones 4 or 8 layers.
# One case per mechanism this file is the proof of; where another file trains a layout against the
# same reference (20 steps, relative 1e-5), it is not trained again here:
# - tp without sp, tp2 x pp2 x dp2 with ZeRO-0 (the default layout, several buckets a rank):
#   tests/multirank/test_eval.py's test_val_loss_tp2_pp2_dp2 (its evaluations leave training
#   untouched, as its first test shows); tp4 with sp: tests/multirank/test_train_tp.py (tp4 without
#   sp, layer by layer: tests/multirank/test_tensor_model.py);
# - 1F1B, interleaved on pp4 and GPipe: test_train_pp.py; pp2 x dp2 with an uneven split there too;
# - ZeRO-1 with 4 shards (reduce-scatter) and ZeRO-2 over tp slices with sp:
#   tests/multirank/test_train_zero.py; ZeRO-3 (HSDP) over them: tests/multirank/test_hsdp.py; ZeRO-3
#   over dp2: tests/multirank/test_document_mask_parity.py's dp2-z3;
# - Muon on one process, dp2 (ZeRO-0/1), tp2 with sp, tp2 x dp2: tests/multirank/test_muon.py, against
#   torch.optim.Muon itself.
# The 3-D case composes tp with sp, pp 1F1B, ZeRO-1 over dp and recomputation: a fault in any of them
# moves its losses. zb1p's interleaved stages train on tp2 x pp2 with a tied embedding (the first and
# the last stage on two ranks, the copies' gradients summed, vocabulary-parallel); zbv and dualpipev
# on pp2 with a tied embedding (the V's first and last stage on one rank share it) and on pp4
# untied; zbv on pp2 with recomputation, where each block is
# recomputed in I and once more in W (parallel/pipeline/weight_grad.py), each from the micro-batch's
# own saved input: a W step recomputing from any other input moves its losses (the V's two stages
# per rank and two micro-batches in flight are there on pp2 as on pp4; tests/unit/test_weight_grad.py
# counts the recomputations).
MATRIX = [
    case(2, 2, 2, zero=1, model=TWO_LAYERS, extra=("parallel.sequence_parallel=true", "train.activation_checkpointing=true"),
         id="tp2-pp2-dp2-z1-sp-recompute"),
    case(2, 2, 1, model=TIED, extra=(*ZB1P, "parallel.pp_virtual_stages=2"), id="tp2-pp2-dp1-zb1p-v2-tied"),
    case(1, 4, 1, model=EIGHT_LAYERS, extra=ZBV, id="tp1-pp4-dp1-zbv"),
    case(1, 4, 1, model=EIGHT_LAYERS, extra=DUALPIPEV, id="tp1-pp4-dp1-dualpipev"),
    case(1, 4, 1, model=EIGHT_LAYERS, extra=(*ZB1P, "parallel.pp_virtual_stages=2"), id="tp1-pp4-dp1-zb1p-v2"),
    case(1, 2, 1, model=TIED, extra=(*ZBV, "train.activation_checkpointing=true"), id="tp1-pp2-dp1-zbv-tied-recompute"),
    case(1, 2, 2, zero=1, model=TIED, extra=DUALPIPEV, id="tp1-pp2-dp2-z1-dualpipev-tied"),
    case(1, 2, 2, zero=1, model=MUON, id="muon-tp1-pp2-dp2-z1"),
]


@pytest.mark.parametrize("model,layout", MATRIX)
def test_layout_matches_single_process(tmp_path, session_tmp, model, layout):
    ref = reference_losses(session_tmp, [*PARITY, *model])
    got = losses_in_ranks(tmp_path, [*PARITY, *model, "parallel=single", *layout], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
