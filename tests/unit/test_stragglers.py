"""The straggler detector's judgement (trainer3d/observe/stragglers.py), on compute times given
by hand: whom it names, when, and whom it leaves alone; and the clock it reads."""

import random
import statistics

import pytest
import torch

from trainer3d.observe.stragglers import StragglerDetector
from trainer3d.parallel.pipeline.bubble import seconds_between, stamp


def _run(detector, steps):
    """Feed every step; (step, rank, level) of each naming, (step, rank) of each clearing."""
    named, cleared = [], []
    for i, compute in enumerate(steps):
        _, onset, gone = detector.feed(compute)
        named += [(i, r, level) for r, level in onset]
        cleared += [(i, r) for r in gone]
    return named, cleared


def test_a_persistently_slow_rank_is_named_once_its_window_fills():
    detector = StragglerDetector(window=20, threshold=1.25, peers=[[0, 1, 2, 3]])
    steps = [[0.10, 0.10, 0.13, 0.10]] * 30  # rank 2: 1.3x its peers' median
    named, cleared = _run(detector, steps)
    assert [(i, r) for i, r, _ in named] == [(19, 2)] and cleared == []
    assert named[0][2] == pytest.approx(0.13 / 0.10)


def test_a_rank_that_recovers_is_cleared():
    detector = StragglerDetector(window=5, threshold=1.25, peers=[[0, 1]])
    steps = [[0.1, 0.2]] * 5 + [[0.1, 0.1]] * 5
    named, cleared = _run(detector, steps)
    assert [(i, r) for i, r, _ in named] == [(4, 1)]
    # the window's median falls under 1.25 once more than half of it is clean: the 3rd clean step
    assert cleared == [(7, 1)]


def test_noise_and_brief_stalls_name_nobody():
    """1,000 steps of 4 ranks with +-20% independent jitter, and a rank stalled 5x for 5 steps in a
    row (a quarter of the 20-step window): the medians stay under the threshold."""
    rng = random.Random(0)
    steps = [[0.1 * rng.uniform(0.8, 1.2) for _ in range(4)] for _ in range(1000)]
    for i in range(500, 505):
        steps[i][3] *= 5
    named, _ = _run(StragglerDetector(window=20, threshold=1.25, peers=[[0, 1, 2, 3]]), steps)
    assert named == []


def test_peers_are_the_ranks_of_the_same_stage():
    """pp2 x dp2: the last stage (ranks 2, 3: the head and the loss) computes twice as long as
    the first; that is its work, not a straggler. A rank alone on its stage is never judged."""
    detector = StragglerDetector(window=4, threshold=1.25, peers=[[0, 1], [2, 3]])
    named, _ = _run(detector, [[0.1, 0.1, 0.2, 0.2]] * 10)
    assert named == []
    alone = StragglerDetector(window=4, threshold=1.25, peers=[[0], [1]])
    ratios, onset, _ = alone.feed([0.1, 0.5])
    assert ratios == {} and onset == []


def test_the_ratio_is_over_the_peers_median_not_the_whole_group():
    """With two ranks the median of both would cap a straggler's ratio under 2; over its peer's
    it is the plain ratio (5x here)."""
    detector = StragglerDetector(window=1, threshold=1.25, peers=[[0, 1]])
    ratios, onset, _ = detector.feed([0.1, 0.5])
    assert ratios[1] == pytest.approx(5.0) and ratios[0] == pytest.approx(0.2)
    assert onset == [(1, pytest.approx(5.0))]
    assert statistics.median([0.1, 0.5]) == pytest.approx(0.3)


def test_the_clock_is_the_host_on_cpu_and_cuda_events_on_cuda():
    """On CPU a stamp is the host clock (ops run synchronously); on CUDA it must be an event on
    the stream, never host time (which would time the kernel launches, not the kernels):
    without a CUDA device recording one fails instead of falling back to the host clock
    (tests/gpu/test_stragglers_gpu.py times real kernels)."""
    a = stamp(False)
    torch.ones(64, 64) @ torch.ones(64, 64)
    b = stamp(False)
    assert isinstance(a, float) and seconds_between(False, a, b) == b - a >= 0
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            stamp(True)


def test_the_window_median_must_hold_for_persist_steps():
    """window 20, persist 10 (the defaults): a rank slow from step 0 is named at step 28; one slow
    for 18 steps (its median over the threshold at steps 19-27, 9 in a row) is not."""
    steps = [[0.1, 0.2]] * 40
    named, _ = _run(StragglerDetector(window=20, threshold=1.25, peers=[[0, 1]], persist=10), steps)
    assert [(i, r) for i, r, _ in named] == [(28, 1)]
    brief = [[0.1, 0.2]] * 18 + [[0.1, 0.1]] * 40
    named, _ = _run(StragglerDetector(window=20, threshold=1.25, peers=[[0, 1]], persist=10), brief)
    assert named == []
