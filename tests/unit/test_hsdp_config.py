"""HSDP's knob (``parallel.dp_shard``) before launch: the validator's refusals, each naming the
knob and the fix, and the shard and replicate groups the rank order gives (pure arithmetic)."""

import pytest

from trainer3d.config.schema_parallel import zero_shards
from trainer3d.config.validate import ConfigError, layout_of, validate
from trainer3d.parallel.topology import Topology
from tests.unit.test_validate import make

BAD = [
    (["parallel.dp=4", "parallel.zero_stage=1", "parallel.dp_shard=2"],
     "parallel.dp_shard=2 shards FSDP2's parameters, gradients and optimizer state, which parallel.zero_stage=1"),
    (["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=3"],
     "parallel.dp_shard=3 does not divide parallel.dp=4 into equal replicas; set parallel.dp_shard to one of [1, 2, 4]"),
    (["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=0"], "parallel.dp_shard=0"),
    # 2 nodes of 6 ranks: a shard group of 4 consecutive ranks would straddle them (ranks 4-7)
    (["parallel.dp=12", "parallel.zero_stage=3", "parallel.dp_shard=4", "launcher=slurm", "launcher.nodes=2",
      "train.global_batch_size=48"],
     "set parallel.dp_shard to one of [1, 2, 3, 6] (a group inside a node)"),
    (["parallel.dp=2", "parallel.pp=2", "parallel.zero_stage=3", "parallel.dp_shard=1", "train.global_batch_size=64"],
     "parallel.zero_stage=3 with parallel.pp=2"),
]


@pytest.mark.parametrize("overrides,fragment", BAD)
def test_bad_dp_shard_names_the_knob_and_the_fix(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        validate(make(overrides))
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides", [
    ["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"],
    ["parallel.dp=4", "parallel.zero_stage=2", "parallel.dp_shard=4"],
    # 2 nodes of 8 ranks, tp=2: a shard group of dp_shard x tp = 8 ranks is one node; 16, both
    ["parallel.dp=8", "parallel.tp=2", "parallel.zero_stage=3", "parallel.dp_shard=4", "launcher=slurm",
     "launcher.nodes=2", "train.global_batch_size=64"],
    ["parallel.dp=8", "parallel.tp=2", "parallel.zero_stage=3", "parallel.dp_shard=8", "launcher=slurm",
     "launcher.nodes=2", "train.global_batch_size=64"],
])
def test_dp_shard_dividing_dp_with_fsdp_is_accepted(overrides):
    validate(make(overrides))


def test_zero_shards_and_the_layout_marker():
    hsdp = validate(make(["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"]))
    full = validate(make(["parallel.dp=4", "parallel.zero_stage=3"]))
    assert zero_shards(hsdp.parallel) == 2 and zero_shards(full.parallel) == 4
    assert layout_of(hsdp)["dp_shard"] == 2 and "dp_shard" not in layout_of(full)


def test_shard_groups_are_neighbours_and_replicas_stride_over_them():
    """The docstring's picture (trainer3d/parallel/topology.py): 8 ranks, tp=2, dp=4, S=2."""
    topo = Topology(tp=2, pp=1, dp=4, dp_shard=2)
    assert topo.hsdp and topo.shard == 2
    assert sorted(topo.shard_groups()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(topo.replicate_groups()) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # with cp the shard group takes the cp ranks of its dp ranks (FSDP2 shards over dp_shard x cp)
    topo = Topology(tp=1, pp=1, dp=4, cp=2, dp_shard=2)
    assert sorted(topo.shard_groups()) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(topo.replicate_groups()) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert not Topology(tp=1, pp=1, dp=4).hsdp
    with pytest.raises(ValueError, match="dp_shard=3 must divide dp=4"):
        Topology(tp=1, pp=1, dp=4, dp_shard=3)
