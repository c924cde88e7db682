"""The spike watch's statistic and decisions, the skip log, the drill batches and their knobs
(docs/failures.md); tests/multirank/test_spikes.py runs the policies in a real loop."""

import json
import math

import numpy as np
import pytest
import torch

from tests.support.harness import run_ranks
from trainer3d.config.schema import Config, SpikeConfig
from trainer3d.config.validate import ConfigError, validate
from trainer3d.data.loader import build_readers
from trainer3d.data.skips import FILE_NAME, SkipLog, SkipLogError, read_skip_log
from trainer3d.observe.spikes import SpikeWatch, robust_excess


def test_robust_excess_is_the_distance_from_the_median_in_robust_sd():
    rng = np.random.default_rng(0)
    history = rng.normal(3.0, 0.1, size=17).tolist()
    median = float(np.median(history))
    mad = float(np.median(np.abs(np.asarray(history) - median)))
    for value in (median + 0.05, median + 1.0):
        assert robust_excess(history, value) == pytest.approx((value - median) / (1.4826 * mad), rel=1e-12)
    assert robust_excess(history, median - 5.0) == 0.0  # a fall is never a spike
    assert robust_excess([2.0] * 5, 2.5) == math.inf


def _watch(**knobs) -> SpikeWatch:
    return SpikeWatch(SpikeConfig(**{"window": 5, "min_steps": 5, "threshold": 6.0, **knobs}), True, 1, 0)


def test_the_watch_arms_after_min_steps_and_keeps_spikes_out_of_its_history():
    watch = _watch()
    losses = [3.0, 3.1, 2.9, 3.05, 2.95]
    assert all(watch.judge_values(s, v, 1.0).reason is None for s, v in enumerate(losses))
    assert watch.judge_values(5, 30.0, 1.0).reason.startswith("loss 30 is ")  # armed: 5 steps seen
    assert list(watch.losses) == losses  # the spike is not a baseline
    verdict = watch.judge_values(6, 3.0, 50.0)
    assert verdict.reason.startswith("grad_norm 50 is ") and "last 5 steps" in verdict.reason
    assert watch.judge_values(7, float("nan"), 1.0).reason is None  # the non-finite watch's business
    assert list(watch.losses) == losses


def test_nothing_is_judged_before_min_steps():
    watch = _watch(min_steps=8)
    verdicts = [watch.judge_values(s, v, 1.0) for s, v in enumerate([3.0, 3.1, 2.9, 3.0, 3.1, 99.0, 3.0, 3.0])]
    assert [v.reason for v in verdicts] == [None] * 8


def _agree(rank, world):
    # pp2 x dp2 in trainer3d's rank order (dp fastest after tp): ranks 2 and 3 are the last stage.
    watch = SpikeWatch(SpikeConfig(), loss_owner=rank >= 2, dp_cp=2, rank=rank)
    loss = torch.tensor(1.0 + 0.1 * rank) if rank >= 2 else None
    norm = torch.tensor(4.0 + rank / 7)  # different on every rank here; the agreed one is rank 0's
    return watch.agreed(loss, norm)


def test_every_rank_agrees_on_the_mean_loss_and_rank0s_norm():
    results = run_ranks(_agree, 4, timeout=120)
    want = [float(torch.tensor(1.2) + torch.tensor(1.3)) / 2, float(torch.tensor(4.0))]
    assert results == [want] * 4


def test_the_skip_log_is_written_whole_and_read_back(tmp_path):
    log = SkipLog(str(tmp_path), extra=[3], writer=True)
    assert 3 in log and 7 not in log and not (tmp_path / FILE_NAME).exists()
    log.add([7, 8], {"step": 8, "loss": 9.5, "reason": "loss", "action": "rollback to step 5, skip steps 7-8"})
    assert json.loads((tmp_path / FILE_NAME).read_text()) == {
        "steps": [7, 8], "events": [{"step": 8, "loss": 9.5, "reason": "loss", "action": "rollback to step 5, skip steps 7-8"}]}
    again = SkipLog(str(tmp_path), extra=[], writer=False)
    assert sorted(again.steps) == [7, 8]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("text", ['{"steps": [1, -2]}', '{"steps": "1"}', "[1, 2]", "{", '{"steps": [true]}'])
def test_a_bad_skip_log_is_refused_naming_the_file(tmp_path, text):
    (tmp_path / FILE_NAME).write_text(text)
    with pytest.raises(SkipLogError, match=f"{FILE_NAME}.*(repair or delete)"):
        read_skip_log(str(tmp_path))


@pytest.mark.parametrize("knob", ["skip_steps", "corrupt_steps"])
def test_steps_outside_the_run_are_refused(knob):
    cfg = Config(run_dir="/tmp/unused")
    cfg.train.max_steps = 10
    target = cfg.train if knob == "skip_steps" else cfg.train.inject
    setattr(target, knob, [3, 10])
    with pytest.raises(ConfigError, match=rf"train\.(inject\.)?{knob}: \[10\] are not steps of this run"):
        validate(cfg)


def _readers_cfg(run_dir, dp=1, corrupt=()):
    cfg = Config(run_dir=str(run_dir))
    cfg.parallel.dp = dp
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 8, None
    cfg.train.seq_len, cfg.train.inject.corrupt_steps = 16, list(corrupt)
    return validate(cfg)


def test_a_drill_batch_is_random_ids_the_same_for_every_reader(tmp_path):
    cfg = _readers_cfg(tmp_path, corrupt=[4])
    whole, _ = build_readers(cfg, dp=1, dp_rank=0)
    inputs, targets = whole.batch(4)
    assert torch.equal(inputs[..., 1:], targets[..., :-1])  # one window per sample, shifted
    assert int(inputs.min()) >= 0 and int(inputs.max()) < cfg.model.vocab_size
    # 128 uniform draws over 257 ids give 257 * (1 - exp(-128/257)) ~ 100 distinct ones; text far fewer.
    assert len(torch.unique(inputs)) > 80
    dp2 = _readers_cfg(tmp_path, dp=2, corrupt=[4])
    halves = [build_readers(dp2, dp=2, dp_rank=r)[0].batch(4)[0] for r in range(2)]
    assert torch.equal(torch.cat([h.reshape(-1, 16) for h in halves]), inputs.reshape(-1, 16))
    first_stage, _ = build_readers(cfg, dp=1, dp_rank=0, inputs=True, targets=False)
    last_stage, _ = build_readers(cfg, dp=1, dp_rank=0, inputs=False, targets=True)
    assert torch.equal(first_stage.batch(4)[0], inputs) and torch.equal(last_stage.batch(4)[1], targets)
    reference, _ = build_readers(_readers_cfg(tmp_path), dp=1, dp_rank=0)
    assert torch.equal(whole.batch(3)[0], reference.batch(3)[0])  # other steps untouched
    assert not torch.equal(inputs, reference.batch(4)[0])
