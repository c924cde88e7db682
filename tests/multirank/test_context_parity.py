"""Context parallelism trains the model one process trains: per-step fp32 losses within a
relative 1e-5 over 20 steps (tests/support/runs.py: PARITY) of the 1-rank run with the same
global batch, seed and data, for cp alone, cp with grouped-query attention, cp beside
tensor (with sequence parallelism) and pipeline parallelism, cp beside data parallelism
with ZeRO-1 and with FSDP2's ZeRO-3, and both exchanges (ring, all-gather)."""

import pytest

from tests.support.runs import PARITY, assert_parity, losses_in_ranks, reference_losses

GQA = ("model.n_heads=4", "model.n_kv_heads=2")


def case(cp, tp=1, pp=1, dp=1, zero=0, model=(), extra=(), slow=True, id=None):
    layout = (f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
              f"parallel.zero_stage={zero}")
    return pytest.param(model, (*layout, *extra), id=id or f"cp{cp}-tp{tp}-pp{pp}-dp{dp}-z{zero}",
                        marks=[pytest.mark.slow] if slow else [])


MATRIX = [
    case(2, slow=False),
    case(2, extra=("parallel.cp_attention=all_gather",), id="cp2-all_gather"),
    case(4, model=GQA, id="cp4-gqa"),
    case(2, tp=2, pp=2, extra=("parallel.sequence_parallel=true",), id="cp2-tp2-pp2-sp"),
    case(2, dp=2, zero=1),
    case(2, dp=1, zero=3, id="cp2-z3-fsdp2"),
]


@pytest.mark.parametrize("model,layout", MATRIX)
def test_context_parallel_matches_single_process(tmp_path, session_tmp, model, layout):
    ref = reference_losses(session_tmp, [*PARITY, *model])
    got = losses_in_ranks(tmp_path, [*PARITY, *model, "parallel=single", *layout], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
