"""A small validation split evaluates on the windows it has, the last global batch partial.

A 150,000-byte token file of this Python's own source, split by ``data.val_fraction``: 0.01
holds out 1,500 tokens, (1,500 - 1) // 64 = 23 windows of seq_len + 1 = 65 tokens (one whole
global batch of 16 and 7 more); 0.0025 holds out 375, 5 windows (fewer than one global
batch). Each run trains 2 steps (PARITY's batch, fp32) and evaluates once, after the last.

The reference is independent of the evaluator: the single process's final checkpoint loaded
into the plain model, its summed cross-entropy (float64) over exactly those windows, read
from the file's tail by hand, divided by their token count. The single process and every
layout must equal it (relative 1e-5); the layouts put the padding differently (dp2: one rank's
whole share of the last batch is padding; pipelines split it over micro-batches; cp2 reads half
of each window), which a mean of micro-batch means would not survive.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.runs import PARITY, REL_TOL, configure, read_metrics, train_in_ranks
from trainer3d.checkpoint import store
from trainer3d.checkpoint.export import load_full_model
from trainer3d.data import BYTE_LEVEL, write_token_file
from trainer3d.model.transformer import Transformer

N_TOKENS, SEQ = 150_000, 64
FRACTIONS = {0.01: 23, 0.0025: 5}  # val_fraction: windows, by the hand count above
# Micro-batches of 2 on purpose (not tests/support/runs.py: parity_micro_batches): the padding
# of the last evaluation batch falls across several micro-batches per rank (comments below).
# by_hand reads the final checkpoint, which a PARITY run saves only when asked (tests/support/runs.py).
RUN = ("train.max_steps=2", "train.eval_every=2", "optim.warmup_steps=1", "train.micro_batch_size=2",
       "checkpoint.save_final=true")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    text = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("[a-c]*.py")))
    assert len(text) >= N_TOKENS
    ids = np.frombuffer(text[:N_TOKENS], dtype=np.uint8).astype(np.int64)
    return write_token_file(tmp_path_factory.mktemp("corpus") / "small.bin", ids, 257, BYTE_LEVEL, eos_id=256)


def overrides(corpus: Path, fraction: float, layout=()):
    return [*PARITY, *RUN, "data=tokens", f"data.path={corpus}", f"data.val_fraction={fraction}",
            "parallel=single", *layout]


def val_loss(run: Path) -> float:
    (value,) = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]
    return value


def by_hand(run: Path, corpus: Path, fraction: float) -> float:
    """The run's final model's mean token loss over the split's windows, computed directly."""
    cfg = configure(run / "again", overrides(corpus, fraction))
    model = Transformer(cfg.model)
    model.load_state_dict(load_full_model(store.step_dir(run / "checkpoints", 2)))
    tokens = np.fromfile(corpus, dtype=np.uint16) if corpus.stat().st_size == 2 * N_TOKENS else None
    assert tokens is not None, "a uint16 token file with no header inside it"
    n_val = int(N_TOKENS * fraction)
    n_windows = (n_val - 1) // SEQ
    assert n_windows == FRACTIONS[fraction]
    start = N_TOKENS - n_val
    windows = torch.tensor(np.stack([tokens[start + w * SEQ:start + w * SEQ + SEQ + 1] for w in range(n_windows)])
                           .astype(np.int64))
    with torch.no_grad():
        logits = model(windows[:, :-1])
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), windows[:, 1:].reshape(-1),
                            reduction="sum")
    return total.item() / (n_windows * SEQ)


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """val_fraction -> (the single process's val_loss, the hand computation), each run once when first asked."""
    made = {}

    def reference(fraction):
        if fraction not in made:
            run = tmp_path_factory.mktemp(f"single-{fraction}")
            train_in_ranks(run, overrides(corpus, fraction))
            made[fraction] = (val_loss(run), by_hand(run, corpus, fraction))
        return made[fraction]

    return reference


def check(tmp_path, corpus, references, fraction, layout):
    train_in_ranks(tmp_path, overrides(corpus, fraction, layout))
    single, hand = references(fraction)
    got = val_loss(tmp_path)
    print(f"val_fraction={fraction} {layout}: val_loss {got:.8f}, single {single:.8f}, by hand {hand:.8f}")
    assert abs(single - hand) / hand <= REL_TOL
    assert abs(got - hand) / hand <= REL_TOL


def test_dp2_a_rank_whose_last_share_is_padding(tmp_path, corpus, references):
    # 23 windows, dp2 x micro 2 x 4 micro-batches: batch 1's samples 16..22 are real, rank 0
    # holds 16..23 (one padding window), rank 1 24..31 (all padding)
    check(tmp_path, corpus, references, 0.01, ["parallel.dp=2", "parallel.zero_stage=1"])


@pytest.mark.slow
def test_tp2_sp_pp2_1f1b_whole_logits(tmp_path, corpus, references):
    # the vocabulary-parallel loss on whole logits (train.loss_chunk_tokens=0), the sequence gathered for the head
    check(tmp_path, corpus, references, 0.01, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2",
                                               "train.loss_chunk_tokens=0"])


@pytest.mark.slow
def test_pp2_interleaved_dp2_fewer_than_a_batch(tmp_path, corpus, references):
    check(tmp_path, corpus, references, 0.0025, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                                 "parallel.pp_virtual_stages=2", "parallel.dp=2"])


@pytest.mark.slow
def test_cp2_dp2_zero3_fewer_than_a_batch(tmp_path, corpus, references):
    check(tmp_path, corpus, references, 0.0025, ["parallel.cp=2", "parallel.dp=2", "parallel.zero_stage=3"])
