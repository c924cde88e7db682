"""The laptop recipes train: the real SmolLM2-135M on the recipes' own layout (two CPU ranks,
ZeRO-3), shortened to a few small steps. What is under test is the recipes' config, so the
entry point's work runs on ranks forked from the harness's forkserver (tests/support/runs.py
train_in_ranks: the same compose, validate, data check and TrainTask); the launcher that
starts fresh interpreters has its own tests in tests/integration."""

import math

import numpy as np
import pytest

from tests.support.runs import configure, read_metrics, train_in_ranks
from trainer3d.data.chat_sample import chat_sample
from trainer3d.data.doc_index import document_starts
from trainer3d.data.tokenfile import TokenFile

SHORT = ("train.max_steps=2", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
         "train.log_every=1", "train.eval_every=0", "checkpoint.save_final=false")


@pytest.mark.slow
def test_smollm2_135m_laptop_recipe_trains(tmp_path):
    train_in_ranks(tmp_path, ["experiment=smollm2-135m-laptop", *SHORT], timeout=540)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    # A fresh model's prediction is close to uniform over the 49,152-token vocabulary (its
    # logits' spread adds about half their variance, ~0.5 with init_std 1/sqrt(dim)).
    assert abs(rows[0]["loss"] - math.log(49152)) < 1.5


# Two of SmolLM2's 30 layers: what the SFT test checks is the recipe's data and loss (the masks,
# the document index, the tokens counted), which the layers in between do not touch; the laptop
# test above trains the recipe's whole model. Its vocabulary stays, so a fresh model's first loss
# is still about log(49,152). Three steps: the masked loss falls by more than 1.0 in the first
# (11.18 -> 9.62 -> 7.80 at tree e1128ea), so the fall is judged with a wide margin.
SFT_STEPS = 3
SFT_SHORT = (f"train.max_steps={SFT_STEPS}", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
             "train.log_every=1", "optim.warmup_steps=2", "checkpoint.save_final=false", "model.n_layers=2")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_recipe_trains_on_the_assistants_tokens(tmp_path):
    """The SFT recipe, as its one command runs it, shortened (and two layers deep): the built-in conversations rendered
    into the cache with their document index (each conversation a document, which the recipe's
    data.document_mask attends within), the masked loss (the assistant's tokens) falls from a
    fresh model's uniform guess, and tokens/s counts every token of the step, kept or not. (That
    a masked-out target's label changes nothing is tests/unit/test_loss_mask.py's; that the
    masked loss is the global batch's mean, tests/multirank/test_loss_mask_parity.py's.)"""
    overrides = ["experiment=sft-smollm2-135m-laptop", *SFT_SHORT, f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = configure(tmp_path, overrides)  # renders the conversations into the cache
    assert cfg.data.loss_mask and cfg.data.document_mask
    tokens = TokenFile.open(chat_sample(cfg.data.cache_dir))
    starts = document_starts(tokens)  # the index, not the end-of-document fallback (None)
    assert starts is not None and len(starts) == int((np.asarray(tokens.tokens) == tokens.header.eos_id).sum())
    train_in_ranks(tmp_path, overrides, timeout=840)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(SFT_STEPS))
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(49152)) < 1.5
    assert losses[-1] < losses[0] - 1.0, losses
    for r in rows:  # 4 sequences x 32 tokens per step, every one processed
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(4 * 32, rel=1e-6)
