"""A loss mask (data.loss_mask) trains the same model in every layout, and its loss is the mean
over the kept tokens of the whole global batch.

The data is the built-in conversations (data=chat_sample: the assistant's tokens kept, about a
third of them), so the micro-batches of a step keep different numbers of tokens: a loss
normalised per micro-batch or per rank, rather than by the global batch's count, gives each
layout (its own micro-batches, its own ranks) a different gradient, and the parity cases fail.
The reference for the definition itself is a direct computation in this process: the initial
model (the run's own seeded initialisation, layout-free) and torch's cross-entropy summed over
the kept targets of each global batch, divided by their count.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.support.runs import PARITY, TWO_LAYERS, assert_parity, configure, losses_in_ranks, reference_losses
from trainer3d.data.loader import build_readers
from trainer3d.data.loss_mask import IGNORE_INDEX
from trainer3d.parallel.parallelize import build_model_chunks
from trainer3d.parallel.topology import ParallelDims, Topology

SFT = ("data=chat_sample", "model=tiny", "model.vocab_size=259", *TWO_LAYERS)  # every case: at most two stages


def _sft(session_tmp):
    return (*PARITY, *SFT, f"data.cache_dir={session_tmp / 'cache'}")


def case(tp, pp, dp, extra=(), id=None, slow=True):
    layout = (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", *extra)
    return pytest.param(layout, id=id, marks=[pytest.mark.slow] if slow else [])


# pp2 x dp2 is also the case of dp with accumulation: each rank runs 2 micro-batches of its share
# (tests/support/runs.py: parity_micro_batches), each keeping its own count of tokens, so a loss
# normalised per micro-batch or per dp rank moves its losses as a dp2 x accumulation-2 run's would.
CASES = [
    case(2, 1, 1, ("parallel.sequence_parallel=true",), id="tp2-sp"),
    case(1, 2, 2, ("parallel.zero_stage=1",), id="pp2-dp2", slow=False),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", CASES)
def test_masked_loss_matches_single_process(tmp_path, session_tmp, layout):
    ref = reference_losses(session_tmp, list(_sft(session_tmp)))
    got = losses_in_ranks(tmp_path, [*_sft(session_tmp), "parallel=single", *layout], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")


def _hand_losses(cfg, steps):
    """Each step's masked mean by hand: the initial model in this process, torch's cross-entropy
    summed over the global batch's kept targets, divided by their count."""
    dims = ParallelDims(topo=Topology(tp=1, pp=1, dp=1, cp=1), rank=0, mesh=None, tp_group=None, dp_group=None,
                        pp_group=None, device=torch.device("cpu"))
    model = build_model_chunks(cfg, dims)[0]
    reader, _ = build_readers(cfg, dp=1, dp_rank=0)  # one reader of the whole global batch
    reader.micro, reader.accum = cfg.train.global_batch_size, 1
    out = []
    with torch.no_grad():
        for step in range(steps):
            inputs, targets = reader.batch(step)
            logits = model(inputs[0])
            if logits.shape[:2] != targets[0].shape:  # the model returns sequence-first
                logits = logits.transpose(0, 1)
            total = F.cross_entropy(logits.flatten(0, 1).float(), targets[0].flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
            kept = int((targets[0] != IGNORE_INDEX).sum())
            assert 0 < kept < targets[0].numel()
            out.append(total.item() / kept)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_masked_loss_is_the_global_batch_mean_by_hand(tmp_path, session_tmp):
    """At lr 1e-12 (updates of about 1e-12 per weight) every step's loss is the initial model's
    to far below the tolerance, so a dp2 x grad-accum-2 run's logged losses are each global
    batch's masked mean, computed here by hand."""
    overrides = [*_sft(session_tmp), "train.max_steps=4", "optim.lr=1e-12", "optim.min_lr=0",
                 "optim.warmup_steps=0", "parallel=single",
                 "parallel.dp=2", "train.micro_batch_size=4"]
    got = losses_in_ranks(tmp_path / "run", overrides, timeout=600)
    cfg = configure(tmp_path / "hand", [o for o in overrides if not o.startswith("parallel.dp")])
    want = _hand_losses(cfg, 4)
    assert len(set(round(w, 6) for w in want)) == 4  # four different batches, four different means
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5)
