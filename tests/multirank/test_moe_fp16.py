"""MoE under train.dtype=fp16: the balance losses' gradient follows the dynamic loss scale.

The language-model loss is multiplied by the loss scale S before backward and every gradient
divided by S after it (optim/mixed_precision.py); the aux and z losses start their backward
inside the blocks (model/moe.py, ``_AuxLossGrad``), so they must be multiplied by the same S.
Scaling by a power of two is exact in floating point short of overflow and of values below
fp16's normal range, so one step's unscaled router gradients at S = 2^10 and 2^14 agree up to
that rounding (measured: max difference 1.3e-4 of the largest
gradient). Were the losses' gradient not multiplied by S, the router's gradient would carry
2^-10 of the aux and z losses' part in one run and 2^-14 in the other (measured: 3.2e-2 of
the largest gradient, with the loss scale left out of ``_AuxLossGrad``); the bound, 2e-3,
sits an order of magnitude from each. Both runs compute the same fixed batch: nothing here
depends on the machine's speed.
"""

import pytest
import torch

from tests.support.harness import dims_for, run_ranks
from tests.support.tolerance import scaled_max_diff
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer


def _router_grads(rank, world, run_dir, loss_scale):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.timeout_s = 60
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 4, None, 32
    t.max_steps, t.dtype, t.loss_scale_init = 1, "fp16", loss_scale
    cfg.model.n_layers = 2
    m = cfg.model.moe
    m.num_experts, m.top_k, m.expert_ffn_dim, m.aux_loss_coef, m.z_loss_coef = 4, 4, 64, 1.0, 0.1
    trainer = Trainer(validate(cfg), dims_for())
    inputs, targets = trainer.data.get(0)
    trainer.optimizer.zero_grad()
    trainer.forward_backward(inputs, targets)
    trainer.grads.finalize()  # the dp reduction, and fp16's unscaling
    grads = [trainer.optimizer.grad(trainer.chunks[0].layers[str(i)].feed_forward.router.weight) for i in range(2)]
    trainer.data.close()
    return [g.float().tolist() for g in grads]


@pytest.mark.slow
def test_fp16_moe_gradient_is_the_same_at_any_loss_scale(tmp_path):
    low = run_ranks(_router_grads, 1, str(tmp_path / "low"), 2.0 ** 10, timeout=300)[0]
    high = run_ranks(_router_grads, 1, str(tmp_path / "high"), 2.0 ** 14, timeout=300)[0]
    for a, b in zip(low, high):
        a, b = torch.tensor(a), torch.tensor(b)
        assert b.abs().max() > 0
        worst = scaled_max_diff(a, b)
        print(f"router gradient: max |difference| / max |gradient| = {worst:.1e}")
        assert worst <= 2e-3
