"""The laptop recipe trains: the real SmolLM2-135M on the recipe's own layout (two CPU ranks,
ZeRO-3), through the entry point, shortened to a few small steps."""

import math

import pytest

from tests.support.runs import read_metrics, run_train

SHORT = ("train.max_steps=2", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
         "train.log_every=1", "train.eval_every=0", "checkpoint.save_final=false")


@pytest.mark.slow
def test_smollm2_135m_laptop_recipe_trains(tmp_path):
    run_train(tmp_path, ["experiment=smollm2-135m-laptop", *SHORT], timeout=540)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    # A fresh model's prediction is close to uniform over the 49,152-token vocabulary (its
    # logits' spread adds about half their variance, ~0.5 with init_std 1/sqrt(dim)).
    assert abs(rows[0]["loss"] - math.log(49152)) < 1.5
