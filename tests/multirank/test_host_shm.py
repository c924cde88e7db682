"""parallel/host_shm.py: ZeRO's all-reduce and all-gather through shared memory among the CPU
ranks of one host, against gloo's own collectives on the same real groups; chunking, in-place
gathers, low-precision gathers, subgroups, the fall-back, a dead peer, nothing left in /dev/shm."""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_ranks
from trainer3d.job.local_ranks import _context, _rank_main
from trainer3d.parallel import comm
from trainer3d.parallel.host_shm import HostCollectives, host_collectives


def _segments() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("trainer3d-")}


def _against_gloo(rank, world, numel, chunk_elems):
    group = dist.new_group(list(range(world)))
    shm = host_collectives(group, chunk_elems)
    assert isinstance(shm, HostCollectives)
    assert shm.chunk_bytes >= 4 * chunk_elems
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g) * (rank + 1)
    mine, theirs = x.clone(), x.clone()
    comm.all_reduce_avg(mine, shm).wait()
    comm.all_reduce_avg(theirs, group).wait()
    out = {"reduce_err": (mine - theirs).abs().max().item(), "reduced": mine}
    # ZeRO-1's gather: this rank's slice of the flat buffer, in place, fp32 and bf16
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.zeros(numel * world, dtype=dtype)
        flat[rank * numel:(rank + 1) * numel] = torch.arange(numel, dtype=torch.float32).to(dtype) + 1000 * rank
        comm.all_gather(flat, flat[rank * numel:(rank + 1) * numel], shm).wait()
        want = torch.cat([torch.arange(numel, dtype=torch.float32).to(dtype) + 1000 * r for r in range(world)])
        out[f"gather_{dtype}"] = torch.equal(flat, want)
    # reduce-scatter: this rank's slice of the average
    y = torch.randn(numel * world, generator=g)
    part, ref = torch.empty(numel), torch.empty(numel)
    comm.reduce_scatter_avg(part, y.clone(), shm).wait()
    full = y.clone()
    dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group)
    ref.copy_(full[rank * numel:(rank + 1) * numel])
    out["scatter_err"] = (part - ref).abs().max().item()
    inplace = y.clone()  # ZeRO-1's: the output is this rank's shard of the input itself
    comm.reduce_scatter_avg(inplace[rank * numel:(rank + 1) * numel], inplace, shm).wait()
    out["scatter_in_place_err"] = (inplace[rank * numel:(rank + 1) * numel] - ref).abs().max().item()
    return out


@pytest.mark.parametrize("world,numel,chunk", [(2, 1000, 1000), (3, 100_003, 4096), (4, 77, 1024)],
                         ids=["one-chunk", "many-chunks-uneven", "short"])
def test_matches_gloo(world, numel, chunk):
    before = _segments()
    results = run_ranks(_against_gloo, world, numel, chunk, timeout=120)
    for r in results:
        assert r["reduce_err"] <= 1e-6 * max(1.0, r["reduced"].abs().max().item())
        assert r["gather_torch.float32"] and r["gather_torch.bfloat16"]
        assert r["scatter_err"] <= 1e-6 and r["scatter_in_place_err"] <= 1e-6
    # every rank holds the same bits: each element was summed by one rank
    assert all(torch.equal(r["reduced"], results[0]["reduced"]) for r in results)
    assert _segments() == before  # unlinked as soon as every rank had mapped it


def _deferred(rank, world):
    """A handle runs its collective when waited for, once; ranks waiting in the same order meet."""
    shm = host_collectives(dist.new_group([0, 1]), 64)
    a, b = torch.full((64,), float(rank)), torch.full((64,), 10.0 * rank)
    first, second = comm.all_reduce_avg(a, shm), comm.all_reduce_avg(b, shm)
    untouched = a[0].item() == rank and not first.is_completed()
    second.wait()
    first.wait()
    first.wait()  # a second wait does nothing
    return untouched, first.is_completed(), a[0].item(), b[0].item()


def test_a_handle_runs_its_collective_when_waited_for():
    assert run_ranks(_deferred, 2, timeout=60) == [(True, True, 0.5, 5.0)] * 2


def _subgroups(rank, world):
    """dp groups of a pp x dp layout: {0, 2} and {1, 3}, each its own segment."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    shm = host_collectives(group, 64)
    x = torch.full((64,), float(rank))
    comm.all_reduce_avg(x, shm).wait()
    return x[0].item()


def test_each_subgroup_reduces_among_its_own_ranks():
    assert run_ranks(_subgroups, 4, timeout=120) == [1.0, 2.0, 1.0, 2.0]


def _switched_off(rank, world):
    os.environ["TRAINER3D_SHM_COLLECTIVES"] = "0"
    return host_collectives(dist.new_group([0, 1]), 64) is None


def test_switched_off_stays_on_gloo():
    assert run_ranks(_switched_off, 2, timeout=60) == [True, True]


def _peer_dies(rank, world):
    shm = host_collectives(dist.new_group([0, 1]), 1024)
    x = torch.ones(1024)
    comm.all_reduce_avg(x, shm).wait()
    if rank == 1:
        os._exit(0)  # gone without a word
    started = time.monotonic()
    try:
        comm.all_reduce_avg(x, shm).wait()
    except Exception as e:  # gloo's barrier raises after the group's timeout
        return ("raised", time.monotonic() - started, type(e).__name__)
    return ("returned", time.monotonic() - started, "")


def test_a_dead_peer_ends_the_collective_within_the_group_timeout():
    """Rank 1 exits between two all-reduces: rank 0's barrier raises after the 5 s group timeout
    (run_ranks would stop at the missing rank; rank 0's own report is read here)."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(_peer_dies, r, 2, os.path.join(tmp, "store"), results, 1, 5, ()))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            rank, status, value = results.get(timeout=90)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert (rank, status) == (0, "ok"), value
    assert value[0] == "raised" and value[1] < 60, value
