"""Optimizer offload with mixture-of-experts blocks on CUDA (parallel.offload_optimizer with
model.moe, docs/moe.md): the experts' gradients copied to pinned host memory on the side stream
(after the reducer scaled them by 1 / ep on the compute stream: parallel/zero/buckets.py), the
host AdamW step of both halves of parallel/expert/optimizer.py, and the parameters back.

The CPU tier holds the arithmetic on gloo (tests/multirank/test_moe_offload.py). Marked
``gpu``; skips without a CUDA device (run ``pytest -m gpu tests/gpu`` on a GPU machine).
"""

import numpy as np
import pytest
import torch

from tests.multirank.test_moe_parity import MOE
from tests.support.runs import PARITY, assert_parity, losses

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (the gpu tier needs one; run "
                                 "`pytest -m gpu` on a GPU machine)")]

CUDA = ("parallel=single", "train.device=cuda")
OFFLOAD = "parallel.offload_optimizer=true"


def test_moe_offloaded_losses_follow_the_device_step(tmp_path):
    """One GPU, bf16, small buckets (copies leave during backward on the side stream): 20 steps
    with offload within bf16's rounding of the same run without it."""
    base = [*PARITY, *MOE, *CUDA, "train.dtype=bf16", "parallel.bucket_mb=0.05"]
    plain = losses(tmp_path / "plain", base)
    offloaded = losses(tmp_path / "offload", [*base, OFFLOAD])
    np.testing.assert_allclose(offloaded, plain, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
def test_dp2_ep2_offloaded_on_two_gpus_matches_one_gpu(tmp_path):
    """fp32 dp2 ep2 ZeRO-1 offloaded over NCCL, rel 1e-5 per step of one GPU without offload."""
    ref = losses(tmp_path / "one", [*PARITY, *MOE, *CUDA], timeout=900)
    got = losses(tmp_path / "ep2", [*PARITY, *MOE, *CUDA, "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=1",
                                     "parallel.bucket_mb=0.05", OFFLOAD], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
