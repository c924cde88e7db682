"""MoE under train.dtype=fp16: the balance losses' gradient follows the dynamic loss scale.

The language-model loss is multiplied by the loss scale S before backward and every gradient
divided by S after it; the aux and z losses start their backward inside the blocks
(model/moe.py, ``_AuxLossGrad``), so they must be multiplied by the same S. Scaling by a power
of two is exact in floating point (short of overflow and of gradients below fp16's normal
range), so two runs that differ only in S (2^4 and 2^12 here) train the same model: the
reference is the run itself at another scale. Were the losses' gradient not multiplied by S,
the router's update would weigh the aux loss 2^8 times less in one run than in the other.
"""

import json
from pathlib import Path

import pytest

from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer


def _train(rank, world, run_dir, loss_scale):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.timeout_s = 60
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 32
    t.max_steps, t.log_every, t.dtype, t.loss_scale_init = 8, 1, "fp16", loss_scale
    cfg.checkpoint.save_final = False
    cfg.model.n_layers = 2
    m = cfg.model.moe
    m.num_experts, m.top_k, m.expert_ffn_dim, m.aux_loss_coef, m.z_loss_coef = 4, 4, 64, 0.1, 0.01
    Trainer(validate(cfg), dims_for()).train()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows]


@pytest.mark.slow
def test_fp16_moe_trains_the_same_at_any_loss_scale(tmp_path):
    low = run_ranks(_train, 1, str(tmp_path / "low"), 2.0 ** 4, timeout=300)[0]
    high = run_ranks(_train, 1, str(tmp_path / "high"), 2.0 ** 12, timeout=300)[0]
    assert len(low) == 8
    worst = max(abs(a - b) / abs(b) for a, b in zip(low, high))
    print(f"worst relative loss difference {worst:.1e}")
    assert worst <= 1e-6, (low, high)
