"""Expert parallelism on NCCL (parallel/expert/dispatch.py, docs/moe.md "Expert parallelism").

The CPU tier holds the arithmetic on gloo (tests/multirank/test_expert_dispatch.py,
test_moe_ep_parity.py). Here, what only a GPU rank does: the counts' and the tokens'
``all_to_all_single`` on NCCL with CUDA tensors (the counts read back to the host for the
split sizes), the permutation built on the device, the grouped SwiGLU on CUDA; and with two
GPUs, dp2 ep2 training the model one GPU trains (the real entry point, 20 fp32 steps,
rel 1e-5). Marked ``gpu``; skips without a CUDA device (run ``pytest -m gpu tests/gpu``).
"""

import pytest
import torch
import torch.distributed as dist

from tests.multirank.test_moe_parity import MOE
from tests.support.runs import PARITY, assert_parity, losses
from trainer3d.model.experts import grouped_swiglu
from trainer3d.model.moe import Experts
from trainer3d.parallel.expert.dispatch import ExpertParallelExperts
from trainer3d.parallel.topology import ParallelDims, Topology

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (the gpu tier needs one; run "
                                 "`pytest -m gpu` on a GPU machine)")]


@pytest.fixture
def one_nccl_rank(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dispatch_on_nccl_matches_the_grouped_swiglu(one_nccl_rank):
    """One NCCL rank as an ep group of one: the exchange, permutation and combine run on the
    device with uneven counts and an empty expert, and give the grouped SwiGLU's output and gradients."""
    device = torch.device("cuda", 0)
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), device)
    dims.ep_group = dist.group.WORLD
    with torch.device("meta"):
        whole = Experts(4, 64, 32)
    module = ExpertParallelExperts(whole, dims).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for p in module.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.1)
    counts = torch.tensor([5, 0, 3, 8], device=device)
    x = torch.randn(16, 64, generator=g, device=device, requires_grad=True)
    y = module(x, counts)
    y.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in (module.w1, module.w3, module.w2)]
    x.grad = None
    weights = [p.detach().clone().requires_grad_(True) for p in (module.w1, module.w3, module.w2)]
    ref = grouped_swiglu(x, *weights, counts)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, [x.grad] + [w.grad for w in weights]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
def test_dp2_ep2_on_two_gpus_matches_one_gpu(tmp_path):
    cuda = ("parallel=single", "train.device=cuda")
    ref = losses(tmp_path / "one", [*PARITY, *MOE, *cuda], timeout=900)
    got = losses(tmp_path / "ep2", [*PARITY, *MOE, *cuda, "parallel.dp=2", "parallel.ep=2",
                                     "parallel.zero_stage=1"], timeout=900)
    print(f"worst relative loss difference {assert_parity(got, ref):.1e}")
