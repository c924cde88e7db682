"""Rank layout as pure maths (no processes), then the DeviceMesh groups on real ranks."""

import itertools

import pytest

from trainer3d.parallel.topology import Topology
from tests.support.harness import dims_for, run_ranks


def test_sixteen_ranks_tp2_pp2_dp4_by_hand():
    topo = Topology(tp=2, pp=2, dp=4)
    # (pp, dp, tp) of every rank (cp = 1), written out from rank = (pp * dp + dp_rank) * tp + tp_rank
    expected = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 3, 1),
                (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1), (1, 3, 0), (1, 3, 1)]
    assert [tuple(topo.coords(r)) for r in range(16)] == [(p, d, 0, t) for p, d, t in expected]
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert topo.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert topo.groups("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert topo.group_of(13, "dp") == [9, 11, 13, 15]


@pytest.mark.parametrize("tp,pp,dp", list(itertools.product([1, 2, 4], [1, 2, 3], [1, 2, 4])))
def test_groups_partition_the_world(tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    for r in range(topo.world_size):
        c = topo.coords(r)
        assert topo.rank(*c) == r
    for dim, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = topo.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert all(len(g) == size for g in groups)
    # TP groups are consecutive ranks (they stay inside a node)
    assert all(g == list(range(g[0], g[0] + tp)) for g in topo.groups("tp"))


def test_bad_layout_refused():
    with pytest.raises(ValueError):
        Topology(tp=0, pp=1, dp=1)
    with pytest.raises(ValueError):
        Topology(tp=2, pp=1, dp=1).coords(2)


def _mesh_groups(rank, world):
    import torch.distributed as dist
    dims = dims_for(tp=2, pp=2, dp=2)
    return {dim: dist.get_process_group_ranks(getattr(dims, f"{dim}_group")) for dim in ("tp", "dp", "pp")}


def test_device_mesh_groups_match_topology():
    topo = Topology(tp=2, pp=2, dp=2)
    results = run_ranks(_mesh_groups, 8, timeout=120)
    for rank, groups in enumerate(results):
        for dim in ("tp", "dp", "pp"):
            assert groups[dim] == topo.group_of(rank, dim), (rank, dim)
