"""model.moe.balance=aux_free in training (DeepSeek-V3, arXiv:2412.19437, sec. 2.1.2).

After every step each MoE block's bias moves by rate * sign(mean load - load) of the global
batch's expert counts. Checked against a hand computation of that update from the routing
metrics (observe/moe.py sums them over the world in its own all-reduce) and against one
process in dp2 and tp2 with sequence parallelism, where each rank routes only part of the
batch (the counts are summed over dp, and over tp under sp); and a resume continues exactly.

Routing is top-2 of 4, so the bias decides which experts run. The parity runs train at lr
1e-12: AdamW moves a weight by about lr, under half a float32 ulp of any weight above ~1e-5,
so the weights stay (all but the tiniest) the initial ones in every layout and the layouts'
rounding of the gradient reductions (~1e-7 relative) cannot reach the router: no near-tie of
its scores is decided differently (a top-k choice is discontinuous: docs/moe.md), and the
counts must match one process's exactly. That needs no near-tie in the data either: every run
records the smallest gap between the 2nd and the 3rd of a token's biased scores that any of its
forwards chose by, and the test holds it above MARGIN. The losses still move from step to step
with the bias and the data.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.support.harness import dims_for, run_ranks
from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.model.moe import moe_blocks
from trainer3d.parallel.expert.balance import moe_buffers
from trainer3d.trainer import Trainer

RATE, EXPERTS, LAYERS = 0.01, 4, 2
FROZEN = 1e-12  # optim.lr (> 0 by validate): the weights all but stay
MARGIN = 1e-6
"""The smallest gap the top-2 choice may rest on: 16 ulps of a float32 score near 0.5 (6e-8 each).
Measured: 2.68e-6 in one process and dp2, 2.65e-6 in tp2-sp; the layouts' rounding moved it by
3e-8, so a gap under MARGIN could be closed by a CPU whose order of sums differs more."""


def _record_margins(chunks) -> list:
    """Each router forward's smallest gap between a token's last chosen and its best unchosen
    biased score (the k-th and the (k+1)-th), the scores ``MoE.route`` chooses by."""
    margins = []

    def hook(block):
        assert block.router_kind == "sigmoid_topk" and block.expert_bias is not None
        k = block.top_k

        def record(router, args, logits):
            with torch.no_grad():
                top = (logits.float().sigmoid() + block.expert_bias).topk(k + 1, dim=-1).values
                margins.append((top[..., k - 1] - top[..., k]).min().item())
        return record

    for block in moe_blocks(chunks):
        block.router.register_forward_hook(hook(block))
    return margins


def _train(rank, world, run_dir, tp, dp, lr, max_steps, resume="never", every=0):
    cfg = Config(run_dir=run_dir)
    p = cfg.parallel
    p.tp, p.dp, p.sequence_parallel, p.timeout_s = tp, dp, tp > 1, 60
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 8, None, 32
    t.max_steps, t.log_every, t.resume = max_steps, 1, resume
    cfg.checkpoint.every, cfg.checkpoint.async_save = every, False
    cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps = lr, 0.0, 0
    cfg.model.n_layers = LAYERS
    m = cfg.model.moe
    m.num_experts, m.top_k, m.expert_ffn_dim, m.router = EXPERTS, 2, 64, "sigmoid_topk"
    m.balance, m.bias_update_rate, m.z_loss_coef = "aux_free", RATE, 0.01
    trainer = Trainer(validate(cfg), dims_for(tp=tp, dp=dp))
    margins = _record_margins(trainer.chunks)
    trainer.train()
    assert margins, "no router forward was recorded"
    return {name: bias.tolist() for name, bias in moe_buffers(trainer.chunks).items()}, min(margins)


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _hand_biases(rows):
    """b += rate * sign(mean - load) per step, from the logged global counts (fp32, as the block)."""
    biases = {}
    for layer in range(LAYERS):
        bias = torch.zeros(EXPERTS)
        for row in rows:
            load = torch.tensor([row[f"moe_tokens/L{layer}/E{e}"] for e in range(EXPERTS)])
            bias += RATE * torch.sign(load.mean() - load)
        biases[f"layers.{layer}.feed_forward.expert_bias"] = bias
    return biases


def _assert_no_near_tie(layout: str, margin: float) -> None:
    """Before the counts are compared: a near-tie would let rounding decide a routing choice."""
    print(f"{layout}: smallest top-2 gap of the biased scores {margin:.2e}")
    assert margin > MARGIN, (f"{layout}: a routing choice rests on a gap of {margin:.1e} < MARGIN = {MARGIN:.0e}, "
                             "so the layouts' rounding may decide it and the counts differ")


def _assert_biases(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(torch.tensor(got[name]), torch.as_tensor(want[name]), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_aux_free_bias_is_the_global_batchs_in_every_layout(tmp_path):
    ref_dir, steps = tmp_path / "one", 8
    ref_bias, margin = run_ranks(_train, 1, str(ref_dir), 1, 1, FROZEN, steps, timeout=300)[0]
    _assert_no_near_tie("one process", margin)
    ref_rows = _rows(ref_dir)
    _assert_biases(ref_bias, _hand_biases(ref_rows))
    assert any(abs(b) > 0 for bias in ref_bias.values() for b in bias)  # the routing was uneven: the bias moved
    for name, tp, dp in (("dp2", 1, 2), ("tp2-sp", 2, 1)):
        run_dir = tmp_path / name
        ranks = run_ranks(_train, tp * dp, str(run_dir), tp, dp, FROZEN, steps, timeout=300)
        _assert_no_near_tie(name, min(margin for _, margin in ranks))
        rows = _rows(run_dir)
        for bias, _ in ranks:  # every rank holds the same bias
            _assert_biases(bias, ref_bias)
        for row, ref in zip(rows, ref_rows, strict=True):
            assert abs(row["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (name, row["step"])
            assert all(row[key] == ref[key] for key in ref if key.startswith("moe_tokens/")), (name, row["step"])


@pytest.mark.slow
def test_aux_free_resume_is_exact(tmp_path):
    """Saved at step 3 and resumed: the bias comes back, so steps 3-5 route and train as the
    uninterrupted run's (at lr 1e-3); a resume that restarted the bias from zero would not."""
    whole = run_ranks(_train, 1, str(tmp_path / "whole"), 1, 1, 1e-3, 6, "never", 3, timeout=300)[0][0]
    saved = store.step_dir(tmp_path / "whole" / "checkpoints", 3)
    resumed = run_ranks(_train, 1, str(tmp_path / "resumed"), 1, 1, 1e-3, 6, str(saved), timeout=300)[0][0]
    _assert_biases(resumed, whole)
    want = [r["loss"] for r in _rows(tmp_path / "whole")][3:]
    assert [r["loss"] for r in _rows(tmp_path / "resumed")] == want
