"""HSDP in the planner: the FSDP2 communication of a step by hand (ring collectives, Patarasuk &
Yuan 2009) for full sharding across nodes and for shard groups inside a node plus the
replicas' all-reduce, and the dp_shard values the search tries."""

import pytest

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.memory.states import ModelStateBytes
from trainer3d.plan.devices import device_for
from trainer3d.plan.search import dp_shards, layout_overrides
from trainer3d.plan.micro_batch_time import RankTimes
from trainer3d.plan.step_time import _dp_exposed

LAYERS, SHARD_ELEMENTS = 4, 10 ** 8  # one rank's padded shard (``ModelStateBytes.sharded``) at each layout


def _cfg(dp_shard):
    cfg = Config(model=ModelConfig(n_layers=LAYERS))
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.parallel.dp_shard = 16, 3, dp_shard
    cfg.train.dtype, cfg.train.grad_accum_steps = "bf16", 1
    return cfg


def _ring(nbytes, n, gbps):  # an all-gather or reduce-scatter's bytes on the wire, seconds
    return (n - 1) / n * nbytes / (gbps * 1e9)


@pytest.mark.parametrize("dp_shard", [None, 8])
def test_fsdp_communication_by_hand(dp_shard):
    """2 nodes x 8 a100-80g, dp=16, ZeRO-3, nothing hidden (zero compute): per micro-batch a
    bf16 all-gather in forward and again in backward, an fp32 reduce-scatter, each one ring
    per unit (4 blocks + the root); plus the first unit's gather waited for. Full sharding
    (n = 16) runs its rings across the nodes, 8 NICs a node (min(intra, 8 x inter)); HSDP
    (S = 8) inside a node on its links, then all-reduces the fp32 shard over 2 replicas
    through one NIC each."""
    device, units = device_for("a100-80g"), LAYERS + 1
    n = 16 if dp_shard is None else dp_shard
    params = SHARD_ELEMENTS * n  # the whole model, n shards of SHARD_ELEMENTS
    gbps = device.intra_gbps if dp_shard else min(device.intra_gbps, 8 * device.inter_gbps)
    hop = units * (n - 1) * device.latency(8) * 1e-6
    gather = _ring(2 * params, n, gbps) + hop
    scatter = _ring(4 * params, n, gbps) + hop
    if dp_shard:  # ring all-reduce over 2 replicas: 2 (R-1)/R of the shard's fp32 bytes, 2 hops per unit
        scatter += 2 * 1 / 2 * 4 * SHARD_ELEMENTS / (device.inter_gbps * 1e9) + units * 2 * device.latency(8) * 1e-6
    want = 2 * gather + scatter + gather / units
    got = _dp_exposed(_cfg(dp_shard), device, ModelStateBytes(0, 0, 0, 0, sharded=SHARD_ELEMENTS), RankTimes(0.0, 0.0, 0.0),
                      ranks_per_node=8, backend="nccl")
    assert got == pytest.approx(want, rel=1e-12)


def test_search_tries_shard_groups_inside_a_node_where_dp_crosses_nodes():
    assert dp_shards(16, 1, 3, 8) == [None, 1, 2, 4, 8]
    assert dp_shards(16, 2, 2, 8) == [None, 1, 2, 4]  # S x tp divides the node's 8 ranks
    assert dp_shards(8, 1, 3, 8) == [None]  # one node: nothing to keep off the network
    assert dp_shards(16, 1, 1, 8) == [None]  # ZeRO-1 shards no parameters
    assert "parallel.dp_shard=8" in layout_overrides(_cfg(8))
