"""The non-finite watch keeps each step's loss and norm and finds the first bad step in one pass."""

import math

import torch

from trainer3d.observe.nonfinite import NEVER, NonFiniteWatch


def _watch(norm_counts: bool = True) -> NonFiniteWatch:
    return NonFiniteWatch(torch.device("cpu"), norm_counts=norm_counts, action="stop")


def test_the_first_non_finite_loss_or_norm_since_the_last_check():
    watch = _watch()
    for step, loss, norm in [(3, 1.0, 2.0), (4, 1.0, math.inf), (5, math.nan, 2.0), (6, 1.0, 2.0)]:
        watch.record(step, torch.tensor(loss), torch.tensor(norm))
    assert watch.first_bad().item() == 4
    assert watch.first_bad().item() == NEVER  # the steps checked are forgotten
    watch.record(7, None, torch.tensor(-math.inf))  # a rank without a loss: its norm alone
    assert watch.first_bad().item() == 7


def test_fp16_counts_the_loss_only():
    watch = _watch(norm_counts=False)
    watch.record(0, torch.tensor(1.0), torch.tensor(math.inf))  # an overflow: the scaler skips it
    watch.record(1, None, torch.tensor(math.nan))  # no loss on this rank: nothing to test
    assert watch.first_bad().item() == NEVER
    watch.record(2, torch.tensor(math.inf), torch.tensor(1.0))
    assert watch.first_bad().item() == 2
