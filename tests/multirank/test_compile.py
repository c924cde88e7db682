"""``train.compile=true`` (trainer3d/parallel/compile.py): the compiled 3D layout trains the
model the uncompiled single process trains, and names its state as that model does."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.compiled import compiled_losses_in_ranks, hooks_launched_every_bucket
from tests.support.runs import PARITY, TWO_LAYERS, assert_parity, reference_losses
from trainer3d.config.schema import ModelConfig
from trainer3d.launch.local_ranks import preload
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.compile import apply_compile, compile_blocks

# Every compiled rank imports inductor (about 2 s of CPU each); the harness's forkserver imports
# it once instead, for every compiled run of the session (this file's and the other files').
preload("torch._inductor.compile_fx")


def test_compile_is_in_place_and_keeps_parameter_names():
    with torch.device("meta"):
        model = Transformer(ModelConfig())
    names = [n for n, _ in model.named_parameters()]
    assert compile_blocks([model]) == ModelConfig().n_layers
    assert [n for n, _ in model.named_parameters()] == names


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_tp2_pp2_zero1_sp_recompute_matches_the_uncompiled_single_process(tmp_path, session_tmp):
    """One run composes compile with TP and sequence parallelism (their collectives inside the
    compiled block), two 1F1B pipeline stages each compiling its block, ZeRO-1's bucket hooks on
    the compiled parameters and activation checkpointing; the reference is the plain eager single
    process of TWO_LAYERS (shared with test_recompute.py and test_eval.py), a block per stage: a
    stage's later blocks reusing its first block's graph is the inductor case's count (one graph
    for two blocks) and test_wgrad.py's. Four ranks: a dp replica would compile the same blocks
    again under its own tp group's name (parallel/compile.py) and prove nothing more about
    compile; ZeRO-1 sharded over two ranks under compile is test_context_parity.py's cp2 case.
    Its subject is the trace (where the collectives, the stages and the recomputation meet the
    compiled block), which aot_eager builds as inductor does (dynamo's graph, AOTAutograd's joint
    graph and partition, the hooks); inductor's lowering of that graph is the next test's."""
    ref = reference_losses(session_tmp, [*PARITY, *TWO_LAYERS])
    layout = ("parallel=single", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "parallel.sequence_parallel=true",
              "train.activation_checkpointing=true", "train.compile=true", "train.compile_backend=aot_eager")
    got, ranks = compiled_losses_in_ranks(tmp_path, [*PARITY, *TWO_LAYERS, *layout, "checkpoint.save_final=true"],
                                          timeout=600)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
    # Each rank compiles its stage's block, one graph (AOTAutograd's; inductor none), and every
    # step the hooks of its parameters launched each of its buckets in backward.
    assert [(r.graphs, r.inductor, hooks_launched_every_bucket(r, len(ref))) for r in ranks] == [(1, 0, True)] * 4, ranks
    saved = dcp.FileSystemReader(str(tmp_path / "checkpoints" / "step_00000020")).read_metadata()
    model_keys = {k for k in saved.state_dict_metadata if k.startswith("model.")}
    with torch.device("meta"):
        expected = {f"model.{n}" for n, _ in Transformer(ModelConfig(n_layers=2)).named_parameters()}
    assert model_keys == expected


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor lowers and builds a block's forward and backward: a minute cold
def test_inductor_compiled_blocks_match_the_uncompiled_single_process(tmp_path, session_tmp):
    """train.compile_backend's default: inductor lowers the block's forward and backward graphs to
    C++ kernels, and the one compiled process trains the eager process's model. The suite's one
    CPU run of inductor's code on whole blocks (the compiled operators' are
    tests/unit/test_weight_grad.py's; the GPU tier's tests/gpu run it on CUDA): one process, as
    inductor builds the same kernels on every rank of a layout. TWO_LAYERS: a second block shows
    the first one's graph reused as a third would, and its reference is shared (test_recompute.py)."""
    ref = reference_losses(session_tmp, [*PARITY, *TWO_LAYERS])
    got, ranks = compiled_losses_in_ranks(tmp_path, [*PARITY, *TWO_LAYERS, "parallel=single", "train.compile=true"],
                                          timeout=600)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
    # one graph for the two blocks (same code and shapes), its forward and backward built by
    # inductor, and the hooks of the compiled parameters launched every bucket in backward
    assert [(r.graphs, r.inductor, hooks_launched_every_bucket(r, len(ref))) for r in ranks] == [(1, 2, True)], ranks


# Zero-bubble schedules compile the model's operators, not whole blocks (parallel/compile.py):
# the input and weight steps each run their half of every backward. One case in the suite; zb1p
# pp2 v2 x tp2 with sp and recompute, compiled, measured 2.4e-7 through the same losses_in_ranks
# (docs/parallelism.md). Its subject is which operators compile and how the schedule splits
# their backwards, which aot_eager traces and partitions as under inductor (parallel/compile.py);
# inductor's kernels for the same operators are tests/unit/test_weight_grad.py's.
ZERO_BUBBLE = [
    pytest.param(("parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"), id="zbv-pp2"),
]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", ZERO_BUBBLE)
def test_compiled_zero_bubble_matches_the_uncompiled_single_process(tmp_path, session_tmp, layout):
    ref = reference_losses(session_tmp, PARITY)
    got, ranks = compiled_losses_in_ranks(tmp_path, [*PARITY, "parallel=single", *layout, "train.compile=true",
                                                     "train.compile_backend=aot_eager"], timeout=1200)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
    # the operators ran compiled on every rank, by the backend asked for
    assert all(r.graphs and not r.inductor for r in ranks), ranks


def test_zero_bubble_schedules_compile_the_operators_and_leave_the_blocks_eager():
    """Under zb1p, zbv and dualpipev ``apply_compile`` sets every module with elementwise operators
    (2 norms, attention, feed-forward per block, and the final norm) and compiles no block; other
    schedules compile every block and set no module."""
    cfg = ModelConfig()
    for pp, schedule, blocks in ((2, "zbv", False), (2, "zb1p", False), (2, "dualpipev", False),
                                 (2, "1f1b", True), (2, "interleaved_1f1b", True), (1, "zbv", True)):
        with torch.device("meta"):
            model = Transformer(cfg)
        count = apply_compile([model], pp, schedule)
        compiled = [b._compiled_call_impl is not None for b in model.layers.values()]  # Module.compile's
        flagged = [m for m in model.modules() if getattr(m, "compile_operators", False)]
        assert compiled == [blocks] * cfg.n_layers, schedule
        assert (count, len(flagged)) == ((cfg.n_layers, 0) if blocks else (4 * cfg.n_layers + 1,) * 2), schedule
