"""trainer3d/cpu/shm.py: ZeRO's all-reduce and all-gather through shared memory among the CPU
ranks of one host, against gloo's own collectives on the same real groups; chunking, in-place
gathers, low-precision gathers, subgroups, the fall-back, nothing left in /dev/shm; the
barrier between the phases (trainer3d/cpu/shm_barrier.py): a waiting rank sleeps, a dead peer is
found at once, a hung one at the group's timeout, gloo's barrier where the library is missing."""

import datetime

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_ranks
from trainer3d.launch.local_ranks import _context, _rank_main, received
from trainer3d.parallel import comm
from trainer3d.cpu.shm import ShmCollectives, shm_collectives
from trainer3d.cpu.shm_barrier import ShmBarrier


def _segments(pid: int) -> set:
    """The segments rank 0 of process ``pid`` made that are still there (other tests' runs
    may hold theirs meanwhile)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"trainer3d-{pid}-")}


def _against_gloo(rank, world, numel, chunk_elems):
    group = dist.new_group(list(range(world)))
    shm = shm_collectives(group, chunk_elems)
    assert isinstance(shm, ShmCollectives)
    assert shm.chunk_bytes >= 4 * chunk_elems
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g) * (rank + 1)
    mine, theirs = x.clone(), x.clone()
    shm.all_reduce_avg(mine).wait()
    comm.GroupCollectives(group).all_reduce_avg(theirs).wait()
    out = {"reduce_err": (mine - theirs).abs().max().item(), "reduced": mine, "pid": os.getpid()}
    # the gradient norm's sum: a few elements, each rank adding all slots in rank order
    sq, want = torch.tensor([0.1 * (rank + 1), 3.0]), torch.tensor([0.1 * (rank + 1), 3.0])
    shm.all_reduce_sum(sq)
    dist.all_reduce(want, group=group)
    out["sum_err"], out["sum"] = (sq - want).abs().max().item(), sq
    # ZeRO-1's gather: this rank's slice of the flat buffer, in place, fp32 and bf16
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.zeros(numel * world, dtype=dtype)
        flat[rank * numel:(rank + 1) * numel] = torch.arange(numel, dtype=torch.float32).to(dtype) + 1000 * rank
        shm.all_gather(flat, flat[rank * numel:(rank + 1) * numel]).wait()
        want = torch.cat([torch.arange(numel, dtype=torch.float32).to(dtype) + 1000 * r for r in range(world)])
        out[f"gather_{dtype}"] = torch.equal(flat, want)
    # reduce-scatter: this rank's slice of the average
    y = torch.randn(numel * world, generator=g)
    part, ref = torch.empty(numel), torch.empty(numel)
    shm.reduce_scatter_avg(part, y.clone()).wait()
    full = y.clone()
    dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group)
    ref.copy_(full[rank * numel:(rank + 1) * numel])
    out["scatter_err"] = (part - ref).abs().max().item()
    inplace = y.clone()  # ZeRO-1's: the output is this rank's shard of the input itself
    shm.reduce_scatter_avg(inplace[rank * numel:(rank + 1) * numel], inplace).wait()
    out["scatter_in_place_err"] = (inplace[rank * numel:(rank + 1) * numel] - ref).abs().max().item()
    return out


@pytest.mark.parametrize("world,numel,chunk", [(2, 1000, 1000), (3, 100_003, 4096), (4, 77, 1024)],
                         ids=["one-chunk", "many-chunks-uneven", "short"])
def test_matches_gloo(world, numel, chunk):
    results = run_ranks(_against_gloo, world, numel, chunk, timeout=120)
    for r in results:
        assert r["reduce_err"] <= 1e-6 * max(1.0, r["reduced"].abs().max().item())
        assert r["gather_torch.float32"] and r["gather_torch.bfloat16"]
        scale = max(1.0, r["reduced"].abs().max().item())  # the averages' magnitude, as the reduce's above
        assert r["scatter_err"] <= 1e-6 * scale and r["scatter_in_place_err"] <= 1e-6 * scale
        assert r["sum_err"] <= 1e-6 and torch.equal(r["sum"], results[0]["sum"])
    # every rank holds the same bits: each element was summed by one rank
    assert all(torch.equal(r["reduced"], results[0]["reduced"]) for r in results)
    assert _segments(results[0]["pid"]) == set()  # unlinked as soon as every rank had mapped it


def _deferred(rank, world):
    """A handle runs its collective when waited for, once; ranks waiting in the same order meet."""
    shm = shm_collectives(dist.new_group([0, 1]), 64)
    a, b = torch.full((64,), float(rank)), torch.full((64,), 10.0 * rank)
    first, second = shm.all_reduce_avg(a), shm.all_reduce_avg(b)
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
    shm = shm_collectives(group, 64)
    x = torch.full((64,), float(rank))
    shm.all_reduce_avg(x).wait()
    return x[0].item()


def test_each_subgroup_reduces_among_its_own_ranks():
    assert run_ranks(_subgroups, 4, timeout=120) == [1.0, 2.0, 1.0, 2.0]


def _switched_off(rank, world):
    os.environ["TRAINER3D_SHM_COLLECTIVES"] = "0"
    return shm_collectives(dist.new_group([0, 1]), 64) is None


def test_switched_off_stays_on_gloo():
    assert run_ranks(_switched_off, 2, timeout=60) == [True, True]


def _sleeping_wait(rank, world):
    """Rank 1 arrives a second late: rank 0 waits for it in the kernel, not on a core."""
    shm = shm_collectives(dist.new_group([0, 1]), 1024)
    x = torch.full((1024,), float(rank))
    shm.all_reduce_avg(x).wait()
    if rank == 1:
        time.sleep(1.0)
    wall, cpu = time.monotonic(), time.process_time()
    shm.all_reduce_avg(x).wait()
    return isinstance(shm._barrier, ShmBarrier), time.monotonic() - wall, time.process_time() - cpu, x[0].item()


def test_a_waiting_rank_sleeps():
    """The property that keeps an oversubscribed host at pace: over a wait of about a second,
    rank 0 uses a few milliseconds of CPU (a spinning or yielding wait would use the second)."""
    (own0, wall0, cpu0, x0), (own1, _, _, x1) = run_ranks(_sleeping_wait, 2, timeout=60)
    assert own0 and own1 and x0 == x1 == 0.5
    assert wall0 > 0.5 and cpu0 < 0.25 * wall0, (wall0, cpu0)


def _no_library_on_rank_1(rank, world, tmp):
    if rank == 1:  # before the barrier's library is first asked for in this process
        os.environ.update(CXX=os.path.join(tmp, "no-such-c++"), TORCH_EXTENSIONS_DIR=os.path.join(tmp, "ext"))
    shm = shm_collectives(dist.new_group([0, 1]), 64)
    x = torch.full((64,), float(rank))
    shm.all_reduce_avg(x).wait()
    return isinstance(shm, ShmCollectives), isinstance(shm._barrier, ShmBarrier), x[0].item()


def test_gloo_barrier_where_a_rank_cannot_build_the_library(tmp_path):
    """One rank without a compiler: both ranks keep the shared segment with gloo's barrier."""
    assert run_ranks(_no_library_on_rank_1, 2, str(tmp_path), timeout=120) == [(True, False, 0.5)] * 2


def _peer_dies(rank, world, hang):
    # a group's own timeout, as trainer3d's groups have (parallel/timeouts.py)
    shm = shm_collectives(dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3)), 1024)
    x = torch.ones(1024)
    shm.all_reduce_avg(x).wait()
    if rank == 1:
        if hang:
            time.sleep(20)  # alive, never arrives
        os._exit(0)  # gone without a word
    started = time.monotonic()
    try:
        shm.all_reduce_avg(x).wait()
    except Exception as e:
        return ("raised", time.monotonic() - started, str(e))
    return ("returned", time.monotonic() - started, "")


@pytest.mark.parametrize("hang", [False, True], ids=["dead", "hung"])
def test_a_lost_peer_ends_the_collective(hang):
    """Rank 1 exits between two all-reduces: rank 0 raises within a fraction of a second, naming
    it (its lock on the segment is gone); rank 1 stays alive but never arrives: rank 0 raises at
    the group's 3 s timeout (run_ranks would stop at the missing rank; rank 0's report is read)."""
    ctx = _context()
    results = ctx.Queue()
    # ignore_cleanup_errors: the ranks' file store deletes its own file as the last one leaves
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(_peer_dies, r, 2, os.path.join(tmp, "store"), results, 1, 60, (hang,)))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            rank, status, value = received(results.get(timeout=90))
        finally:
            procs[1].kill()  # the hung one; the dead one is gone already
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert (rank, status) == (0, "ok"), value
    what, took, message = value
    assert what == "raised", value
    if hang:
        assert 3 <= took < 15 and "timed out" in message, value
    else:
        assert took < 2.5 and "rank 1 of this host exited" in message, value


def _peer_dies_at_the_start(rank, world):
    """Rank 1 receives rank 0's offer of a segment and exits before it answers."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        dist.broadcast_object_list([None], src=0, group=group)
        os._exit(0)
    try:
        shm_collectives(group, 1024)
    except Exception as e:
        return "raised", os.getpid(), str(e).splitlines()[0]
    return "returned", os.getpid(), ""


def test_a_peer_dying_at_the_start_leaves_nothing_in_dev_shm():
    """Rank 0 made the segment and offered it; rank 1 dies before it answers: rank 0's start
    raises (the group's 3 s timeout at most) and the segment's name is gone from /dev/shm."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(_peer_dies_at_the_start, r, 2, os.path.join(tmp, "store"), results, 1, 60, ()))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            rank, status, value = received(results.get(timeout=90))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert (rank, status) == (0, "ok"), value
    what, pid, message = value
    assert what == "raised", value
    assert _segments(pid) == set(), _segments(pid)
