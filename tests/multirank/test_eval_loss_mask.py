"""Evaluation with a loss mask: val_loss is the summed loss of the kept targets of the whole
validation set divided by their count (trainer3d/observe/evaluate.py), not by every target, and
not a mean per data-parallel rank.

The built-in conversations (data=chat_sample: the assistant's tokens kept) are split 3:1; two
dp ranks evaluate all the held-out windows (the last global batch partial, its padding counted
nowhere). At lr 1e-12 the model evaluated after the first step is the initial one to far below
the tolerance, so the reference is computed by hand in this process: the run's own seeded
initial model (init_std 1: token losses far from uniform, so the ranks' own means differ), torch's cross-entropy summed over the kept targets of the validation windows.
The two wrong denominators give numbers this test tells apart (checked before comparing).
"""

import pytest
import torch
import torch.nn.functional as F

from tests.support.runs import configure, read_metrics, train_in_ranks
from trainer3d.data.loader import build_readers
from trainer3d.data.loss_mask import IGNORE_INDEX
from trainer3d.data.sources import eval_windows
from trainer3d.parallel.parallelize import build_model_chunks
from trainer3d.parallel.topology import ParallelDims, Topology

MICRO, DP = 2, 2


def _overrides(cache):
    return ["data=chat_sample", "model=tiny", "model.vocab_size=259", "model.init_std=1.0", f"data.cache_dir={cache}",
            "data.val_fraction=0.25", "train.seq_len=64", f"train.micro_batch_size={MICRO}",
            f"train.global_batch_size={MICRO * DP}", "train.max_steps=1", "train.log_every=1",
            "train.eval_every=1", "train.eval_steps=null", "train.dtype=fp32", "optim.lr=1e-12",
            "optim.min_lr=0", "optim.warmup_steps=0", "checkpoint.save_final=false", "parallel=single"]


def _by_hand(cfg):
    """(kept-target mean over the whole set, mean over every target, mean of the dp ranks' own
    kept-target means): the first is val_loss, the others what a wrong denominator gives."""
    dims = ParallelDims(topo=Topology(tp=1, pp=1, dp=1, cp=1), rank=0, mesh=None, tp_group=None, dp_group=None,
                        pp_group=None, device=torch.device("cpu"))
    model = build_model_chunks(cfg, dims)[0]
    _, val = build_readers(cfg, dp=1, dp_rank=0)
    n = eval_windows(cfg, val.n_windows)
    val.micro, val.accum = cfg.train.global_batch_size, 1  # one reader of each whole global batch
    sums, kept = torch.zeros(DP, dtype=torch.float64), torch.zeros(DP, dtype=torch.float64)
    with torch.no_grad():
        for b in range(-(-n // cfg.train.global_batch_size)):
            inputs, targets = val.batch(b, counted=n)
            logits = model(inputs[0])
            if logits.shape[:2] != targets[0].shape:  # sequence-first
                logits = logits.transpose(0, 1)
            for r in range(DP):  # dp rank r reads rows [r * MICRO, (r + 1) * MICRO) of a global batch
                rows = slice(r * MICRO, (r + 1) * MICRO)
                t = targets[0][rows].clone()
                t[t < 0] = IGNORE_INDEX  # padding windows and masked-out targets
                sums[r] += F.cross_entropy(logits[rows].flatten(0, 1).float(), t.flatten(), reduction="sum",
                                           ignore_index=IGNORE_INDEX).double()
                kept[r] += (t != IGNORE_INDEX).sum()
    assert 0 < kept.sum() < n * cfg.train.seq_len
    return float(sums.sum() / kept.sum()), float(sums.sum()) / (n * cfg.train.seq_len), float((sums / kept).mean())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_masked_val_loss_divides_by_the_kept_targets_of_the_whole_set(tmp_path, session_tmp):
    overrides = _overrides(session_tmp / "cache")
    cfg = configure(tmp_path / "hand", overrides)
    want, all_targets, per_rank = _by_hand(cfg)
    assert abs(all_targets - want) > 1e-3 * want and abs(per_rank - want) > 1e-4 * want, (want, all_targets, per_rank)
    train_in_ranks(tmp_path / "run", [*overrides, f"parallel.dp={DP}"], timeout=540)
    row = next(r for r in read_metrics(tmp_path / "run") if "val_loss" in r)
    assert row["val_loss"] == pytest.approx(want, rel=1e-5), (row["val_loss"], want, all_targets, per_rank)
