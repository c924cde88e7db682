"""Context parallelism trains the model one process trains: per-step fp32 losses within a
relative 1e-5 over 20 steps (tests/support/runs.py: PARITY) of the 1-rank run with the same
global batch, seed and data, for cp alone (ring exchange), cp over 4 ranks with grouped-query
attention, cp beside tensor parallelism with sequence parallelism, beside pipeline parallelism
(interleaved 1F1B), beside FSDP2's ZeRO-3 with the all-gather exchange, recomputation with
compile and ZeRO-1 over cp. Each mechanism is proven once, on the fewest ranks that show it: cp
beside data parallelism with ZeRO-1, whose checkpoint resumes in one process, trains document-masked
data in tests/multirank/test_document_mask_parity.py (one run for both).
"""

import pytest

from tests.support.compiled import compiled_losses_in_ranks, hooks_launched_every_bucket
from tests.support.runs import PARITY, TWO_LAYERS, assert_parity, configure, losses_in_ranks, reference_losses


def case(cp, tp=1, pp=1, dp=1, zero=0, model=(), extra=(), slow=True, id=None):
    layout = (f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
              f"parallel.zero_stage={zero}")
    return pytest.param(model, (*layout, *extra), id=id or f"cp{cp}-tp{tp}-pp{pp}-dp{dp}-z{zero}",
                        marks=[pytest.mark.slow] if slow else [])


# Layouts of at most two pipeline stages train TWO_LAYERS (tests/support/runs.py); the interleaved
# one (4 stages) the tiny model's 4 layers.
MATRIX = [
    case(2, model=TWO_LAYERS, slow=False),
    case(4, model=TWO_LAYERS, id="cp4-gqa"),  # grouped-query: the tiny model's own heads (held below)
    case(2, tp=2, model=TWO_LAYERS, extra=("parallel.sequence_parallel=true",), id="cp2-tp2-sp"),
    case(2, pp=2, extra=("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"),
         id="cp2-pp2-interleaved"),
    case(2, dp=1, zero=3, model=TWO_LAYERS, extra=("parallel.cp_attention=all_gather",), id="cp2-z3-fsdp2-all_gather"),
]


def test_the_cp4_case_trains_grouped_query_attention(tmp_path):
    """cp4-gqa sets no heads: the model its runs compose (conf/model/tiny.yaml, 2 layers) has 4
    query heads sharing 2 key-value heads, so the case trains grouped-query attention against the
    2-layer reference the other cases share."""
    model = configure(tmp_path, [*PARITY, *TWO_LAYERS]).model
    assert (model.n_heads, model.n_kv_heads) == (4, 2)


@pytest.mark.parametrize("model,layout", MATRIX)
def test_context_parallel_matches_single_process(tmp_path, session_tmp, model, layout):
    ref = reference_losses(session_tmp, [*PARITY, *model])
    got = losses_in_ranks(tmp_path, [*PARITY, *model, "parallel=single", *layout], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # dynamo and AOTAutograd trace on every rank at once on 2 loaded cores
def test_cp2_zero1_with_recompute_and_compile_matches_single_process(tmp_path, session_tmp):
    """Activation checkpointing replays the ring in backward; compile builds each block's forward
    around the cp attention (which it leaves eager) inside the recomputation
    (parallel/compile.py); ZeRO-1 shards the optimizer over dp x cp = 2, its bucket hooks firing
    on the compiled blocks' parameters. What it proves is the trace's (where the graph breaks,
    what the checkpoint replays, which hooks fire): aot_eager's, without inductor's code
    (train.compile_backend; inductor's is test_compile.py's)."""
    ref = reference_losses(session_tmp, [*PARITY, *TWO_LAYERS])
    layout = ("parallel=single", "parallel.cp=2", "parallel.zero_stage=1", "train.activation_checkpointing=true",
              "train.compile=true", "train.compile_backend=aot_eager")
    got, ranks = compiled_losses_in_ranks(tmp_path, [*PARITY, *TWO_LAYERS, *layout], timeout=1200)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
    # the blocks ran compiled on both ranks (by aot_eager), and their parameters' hooks launched every bucket
    assert all(r.graphs and not r.inductor and hooks_launched_every_bucket(r, len(ref)) for r in ranks), ranks
