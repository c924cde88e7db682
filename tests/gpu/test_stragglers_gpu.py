"""The straggler watch's clock on CUDA (trainer3d/parallel/pipeline/bubble.py ``stamp``): events on
the stream time the kernels, not their launches. Marked ``gpu``; skips without CUDA."""

import pytest
import torch

from trainer3d.parallel.pipeline.bubble import seconds_between, stamp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "runs where one is)")]


def _timed_spin(cycles: int) -> float:
    start = stamp(True)
    torch.cuda._sleep(cycles)  # a kernel that spins this many clock cycles; the launch returns at once
    end = stamp(True)
    return seconds_between(True, start, end)


def test_events_time_the_kernels_the_host_only_launched():
    torch.cuda.synchronize()
    _timed_spin(1_000_000)  # warm-up: the first launch loads the kernel
    one, two = _timed_spin(50_000_000), _timed_spin(100_000_000)
    # device time, proportional to the cycles spun, whatever the host did meanwhile
    assert 1.8 < two / one < 2.2, (one, two)
    # the host stamps would see only the launch: stamp(False) pairs around the same launch
    host_start = stamp(False)
    start = stamp(True)
    torch.cuda._sleep(100_000_000)
    end = stamp(True)
    host = seconds_between(False, host_start, stamp(False))
    device = seconds_between(True, start, end)
    assert host < device / 2, (host, device)
