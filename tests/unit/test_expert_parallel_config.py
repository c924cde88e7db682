"""Expert parallelism's groups (pure arithmetic, by hand) and its refusals before launch."""

import pytest

from tests.unit.test_validate import make
from trainer3d.config.validate import ConfigError, layout_of, validate
from trainer3d.parallel.topology import Topology


def test_groups_of_eight_ranks_by_hand():
    """tp=2, dp=4, ep=2: an ep group is 2 neighbouring dp ranks of one tp column; the
    expert-dp group joins the ranks at the same place of each ep group (topology.py's example)."""
    topo = Topology(tp=2, pp=1, dp=4, ep=2)
    assert topo.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.expert_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_groups_with_cp_and_pp_by_hand():
    """pp=2, dp=2, cp=2 (tp=1), ep=4: the dp x cp group of a stage is [0,1,2,3] (cp fastest), all one ep group."""
    topo = Topology(tp=1, pp=2, dp=2, cp=2, ep=4)
    assert topo.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.expert_dp_groups() == [[0], [1], [2], [3], [4], [5], [6], [7]]


@pytest.mark.parametrize("tp,pp,dp,cp,ep", [(1, 1, 4, 1, 2), (2, 2, 2, 2, 2), (2, 1, 4, 1, 4), (1, 1, 8, 1, 8)])
def test_groups_partition_each_dp_cp_group(tp, pp, dp, cp, ep):
    """Every rank in exactly one ep group and one expert-dp group, each inside its dp x cp group,
    and an ep group meets an expert-dp group in exactly one rank."""
    topo = Topology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    for groups, size in ((topo.expert_groups(), ep), (topo.expert_dp_groups(), dp * cp // ep)):
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert all(len(g) == size for g in groups)
        for g in groups:
            coords = [topo.coords(r) for r in g]
            assert len({(c.pp, c.tp) for c in coords}) == 1  # inside one dp x cp group
    for a in topo.expert_groups():
        for b in topo.expert_dp_groups():
            assert len(set(a) & set(b)) in (0, 1)


def test_topology_refuses_ep_not_dividing_dp_cp():
    with pytest.raises(ValueError, match="ep=3 must divide dp x cp = 4"):
        Topology(tp=1, pp=1, dp=4, ep=3)


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


@pytest.mark.parametrize("overrides,fragment", [
    (["parallel.dp=4", "parallel.ep=3", "train.global_batch_size=48"],
     "parallel.ep=3 does not divide parallel.dp x parallel.cp = 4 x 1 = 4"),
    (["model.moe.num_experts=6", "parallel.ep=4", "parallel.dp=4"],
     "model.moe.num_experts=6 is not divisible by parallel.ep=4"),
    (["parallel.ep=2", "parallel.zero_stage=2"], "parallel.ep=2 does not run with parallel.zero_stage=2"),
    (["parallel.ep=2", "parallel.zero_stage=3", "parallel.offload_optimizer=true"],
     "parallel.ep=2 does not run with parallel.zero_stage=3"),
    (["parallel.ep=2", "train.dtype=fp16"], "parallel.ep=2 does not run with train.dtype=fp16"),
    (["parallel.ep=2", "optim=muon"], "parallel.ep=2 does not run with optim.name=muon"),
])
def test_impossible_ep_is_refused_naming_the_knob(overrides, fragment):
    cfg = make([*MOE, *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert fragment in str(err.value)


@pytest.mark.parametrize("zero", [0, 1])
def test_ep_with_optimizer_offload_is_accepted(zero):
    """ZeRO-Offload of both halves (parallel/expert/optimizer.py): tests/multirank/test_moe_offload.py."""
    cfg = validate(make([*MOE, "parallel.ep=2", f"parallel.zero_stage={zero}", "parallel.offload_optimizer=true"]))
    assert cfg.parallel.offload_optimizer and cfg.parallel.ep == 2


def test_ep_within_dp_is_accepted_and_recorded_in_the_layout():
    cfg = validate(make([*MOE, "parallel.ep=2"]))
    assert layout_of(cfg)["ep"] == 2
    assert "ep" not in layout_of(validate(make(MOE)))  # markers of runs without ep unchanged
