"""Expert-parallel dispatch and combine (parallel/expert/dispatch.py) against one process.

Two and four gloo ranks each route their own tokens with uneven counts per expert, one expert
receiving no token at all; every rank's output and input gradient, and each rank's slice of
the expert weights' gradient summed over the ep group, equal what one process computes with
all experts whole (model/experts.py's grouped SwiGLU, itself tested against per-expert matmuls
in tests/unit/test_moe.py). The saved tensors are the permutation only, seen by
``saved_tensors_hooks``.
"""

import pytest
import torch

from tests.support.tolerance import assert_close_to_scale
from tests.support.harness import run_ranks
from trainer3d.model.experts import grouped_swiglu
from trainer3d.model.moe import Experts
from trainer3d.parallel.expert.dispatch import ExpertParallelExperts, arrival_order
from trainer3d.parallel.topology import ParallelDims, Topology

E, DIM, FFN = 8, 16, 8


def _inputs(rank: int):
    """Rank ``rank``'s tokens sorted by expert with uneven counts; expert 5 gets none anywhere."""
    counts = torch.tensor([(rank + 3 * e) % 4 if e != 5 else 0 for e in range(E)], dtype=torch.int64)
    x = torch.randn(int(counts.sum()), DIM, generator=torch.Generator().manual_seed(10 + rank))
    return x, counts


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(E, DIM, FFN, generator=g) * 0.3, torch.randn(E, DIM, FFN, generator=g) * 0.3,
            torch.randn(E, FFN, DIM, generator=g) * 0.3]


def _ep_rank(rank: int, world: int, ep: int):
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=ep, ep=ep), torch.device("cpu"))
    w1, w3, w2 = _weights()
    with torch.device("meta"):
        whole = Experts(E, DIM, FFN)
    module = ExpertParallelExperts(whole, dims).to_empty(device="cpu")
    local = slice(dims.ep_rank * E // ep, (dims.ep_rank + 1) * E // ep)
    with torch.no_grad():
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            getattr(module, name).copy_(w[local])
    x, counts = _inputs(rank)
    x.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(x, counts)
    (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
    grads = [getattr(module, n).grad.clone() for n in ("w1", "w3", "w2")]
    index_saved = [t for t in saved if t.dtype == torch.int64]
    return y.detach(), x.grad, grads, dims.ep_rank, len(index_saved)


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_matches_one_process(ep):
    results = run_ranks(_ep_rank, ep, ep, timeout=120)
    w = [t.requires_grad_(True) for t in _weights()]
    full = [torch.zeros_like(t) for t in w]
    for rank, (y, x_grad, grads, ep_rank, index_saved) in enumerate(results):
        x, counts = _inputs(rank)
        x.requires_grad_(True)
        ref = grouped_swiglu(x, *w[:2], w[2], counts)
        (ref * torch.arange(ref.numel()).view_as(ref).sin()).sum().backward()
        assert_close_to_scale(y, ref)
        assert_close_to_scale(x_grad, x.grad)
        local = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
        for f, g in zip(full, grads):
            f[local] = g  # the combine's backward brought every rank's tokens' gradient here
        assert index_saved == 3  # the dispatch's and the combine's permutation, the local counts
    for f, t in zip(full, w):
        assert_close_to_scale(f, t.grad)


def test_arrival_order_is_expert_major():
    """Blocks from 2 sources for 2 local experts, sizes [[2, 0], [1, 3]]: arrived rows
    s0e0 s0e0 s1e0 s1e1 s1e1 s1e1; expert-major: e0 from s0, s1, then e1 from s1."""
    assert arrival_order(torch.tensor([[2, 0], [1, 3]])).tolist() == [0, 1, 2, 3, 4, 5]
    assert arrival_order(torch.tensor([[1, 2], [1, 1]])).tolist() == [0, 3, 1, 2, 4]
