"""data.document_mask through the layouts: each trains the model one process trains.

The token file holds short documents (1 to 80 bytes, so from several documents in a window
of 64 tokens to one that spans two), made by tools/prepare_data.py's engine with its document
index. Each layout's per-step losses over 20 steps (fp32) are held to the one-process run of
the same config within 1e-5 (tests/support/runs.py): tensor with sequence parallelism, FSDP,
the interleaved pipeline beside dp with ZeRO-1 and recomputation; context parallelism with
each exchange, beside dp (its checkpoint resumed in one process) and under compile. The one-process masked model is itself held to each
document run alone in tests/unit/test_document_mask.py.
"""

import random

import pytest

from tests.conftest import ROOT
from tests.support.compiled import compiled_losses_in_ranks
from tests.support.runs import (PARITY, assert_parity, losses_in_ranks, once_per_session, read_metrics, reference_losses,
                                train_in_ranks, train_losses)
from trainer3d.checkpoint import store
from trainer3d.data import prepare
from trainer3d.data.documents import Piece


def short_documents(out):
    """This package's model sources cut into documents of 1 to 80 bytes (seeded)."""
    rng = random.Random(40)
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "trainer3d" / "model").glob("*.py")))
    pieces, at = [], 0
    while at < len(text):
        n = rng.randint(1, 80)
        pieces.append(Piece(text[at:at + n], True))
        at += n
    prepare.prepare(iter(pieces), out, prepare.BYTE_ENCODER)


def document_data(session_tmp):
    out = session_tmp / "short_documents.bin"
    with once_per_session(session_tmp, "short_documents") as first:
        if first:
            short_documents(out)
    return ["data=tokens", f"data.path={out}", "data.document_mask=true", f"data.cache_dir={session_tmp / 'cache'}",
            *SMALL]


# Two blocks of width 64 (head_dim 16, grouped-query): enough for a pipeline of two stages and
# tp 2's heads, and the runs stay short.
SMALL = ("model.dim=64", "model.ffn_dim=192", "model.n_layers=2")


# One case per mechanism: the pipeline with ZeRO-1 and recomputation runs interleaved (test below);
# the ring exchange beside dp with ZeRO-1 and its checkpoint's resumption in one process too (below).
# dp2-z3 is also the suite's 20-step parity of ZeRO-3 over dp2 (tests/multirank/test_train_zero.py).
LAYOUTS = [
    pytest.param(("parallel.tp=2", "parallel.sequence_parallel=true"), id="tp2-sp"),
    pytest.param(("parallel.dp=2", "parallel.zero_stage=3"), id="dp2-z3", marks=pytest.mark.slow),
    # context parallelism (trainer3d/parallel/context/documents.py): each exchange, the ring beside dp
    pytest.param(("parallel.cp=2", "parallel.cp_attention=all_gather"), id="cp2-all_gather"),
]


@pytest.mark.timeout(1500)  # the session's one-process reference and the layout's run: ~9 min at load 40 on 2 cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_document_masked_layout_matches_single_process(tmp_path, session_tmp, layout):
    data = document_data(session_tmp)
    ref = reference_losses(session_tmp, [*PARITY, *data])
    got = losses_in_ranks(tmp_path, [*PARITY, *data, "parallel=single", *layout], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_document_masked_interleaved_pipeline_matches_single_process(tmp_path, session_tmp):
    """Interleaved 1F1B beside dp2 with ZeRO-1 and recomputation: two chunks of one block per rank,
    each stage setting the segments of the micro-batch it runs (trainer3d/parallel/pipeline/
    schedule.py), and each block's recomputed forward seeing them again; four blocks for four stages."""
    data = [*document_data(session_tmp), "model.n_layers=4"]
    ref = reference_losses(session_tmp, [*PARITY, *data])
    layout = ("parallel=single", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
              "parallel.dp=2", "parallel.zero_stage=1", "train.activation_checkpointing=true")
    got = losses_in_ranks(tmp_path, [*PARITY, *data, *layout], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # dynamo and AOTAutograd trace on both ranks at once on 2 loaded cores
def test_document_masked_cp2_with_compile_matches_single_process(tmp_path, session_tmp):
    """train.compile builds each block around the document-masked cp attention and its
    positions (left eager: trainer3d/parallel/context/apply.py), traced by aot_eager
    (train.compile_backend: the trace is the subject; inductor's code is test_compile.py's)."""
    data = document_data(session_tmp)
    ref = reference_losses(session_tmp, [*PARITY, *data])
    got, ranks = compiled_losses_in_ranks(tmp_path, [*PARITY, *data, "parallel=single", "parallel.cp=2",
                                                     "train.compile=true", "train.compile_backend=aot_eager"],
                                          timeout=1200)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
    assert all(r.graphs and not r.inductor for r in ranks), ranks  # the blocks ran compiled on both ranks


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_document_masked_cp2_dp2_zero1_matches_single_process_and_its_checkpoint_resumes_in_one_process(
        tmp_path, session_tmp):
    """The ring exchange beside dp2 with ZeRO-1 (the optimizer state sharded over dp x cp = 4)
    trains the reference's 20 steps; cp is not in the saved state: its checkpoint of step 10 loads
    into one process, which trains on as the reference (the data's document index and the reader's
    position with it). One run for what tests/multirank/test_context_parity.py held of cp2 x dp2
    on unmasked data."""
    data = document_data(session_tmp)
    ref = reference_losses(session_tmp, [*PARITY, *data])
    first, second = tmp_path / "cp2", tmp_path / "single"
    train_in_ranks(first, [*PARITY, *data, "parallel=single", "parallel.cp=2", "parallel.dp=2", "parallel.zero_stage=1",
                           "checkpoint.every=10"], timeout=900)
    print(f"worst relative loss difference {assert_parity(train_losses(first), ref):.1e}")
    stdout = train_in_ranks(second, [*PARITY, *data, "parallel=single",
                                     f"train.resume={store.step_dir(first / 'checkpoints', 10)}"])
    assert "layout changed since the checkpoint" in stdout and "cp 2 -> 1" in stdout
    rows = read_metrics(second)
    assert [r["step"] for r in rows] == list(range(10, 20))
    worst = max(abs(r["loss"] - want) / want for r, want in zip(rows, ref[10:]))
    assert worst <= 1e-5, worst
