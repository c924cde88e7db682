"""The planner proposes optimizer offload for mixture-of-experts layouts where it is what makes
them fit (validate() accepts offload with MoE, ep or not: config/validate_moe.py), the host bytes
of both flat buffers under ep counted (memory/moe.py ``layout_model_state_bytes``)."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.validate import validate
from trainer3d.memory.moe import layout_model_state_bytes
from trainer3d.plan.devices import PRESETS
from trainer3d.plan.search import command, evaluate, host_link, search

H100 = PRESETS["h100-sxm"]


@pytest.mark.slow
def test_search_offloads_expert_parallel_mixtral_where_only_that_fits():
    """Mixtral-8x7B (46.7B parameters) on one node of 8 x H100 80 GB, ZeRO-1: dp8 ep8 holds 5.6B
    expert parameters per rank whose masters and moments (12 bytes each) the expert-dp group of
    one rank cannot shard; it fits only with them on the host, and the plan's command says so."""
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("plan", [
            "model=mixtral-8x7b", "cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=h100-sxm",
            "train.global_batch_size=32", "train.seq_len=4096", "search.micro_batch_sizes=[1]",
            "search.zero_stages=[1]", "search.virtual_stages=[1]", "search.sequence_parallel=[true]",
            "search.recompute=[true]"]))
    usable = H100.usable_bytes(8)
    plans = search(cfg, H100).plans
    offloaded = [p for p in plans if p.cfg.parallel.offload_optimizer and p.cfg.parallel.ep > 1]
    assert any((p.cfg.parallel.dp, p.cfg.parallel.ep) == (8, 8) for p in offloaded)
    for plan in offloaded:
        validate(plan.cfg)
        assert plan.memory.total <= usable and "parallel.offload_optimizer=true" in command(plan.cfg)
        plain = evaluate(dataclasses.replace(plan.cfg, parallel=dataclasses.replace(plan.cfg.parallel,
                                                                                    offload_optimizer=False)),
                         H100, 8, "nccl", link=host_link(cfg))
        assert plain.memory.total > usable


def test_offloaded_expert_buffers_are_host_bytes_by_hand():
    """ep=2 over 4 ranks, ZeRO-1, bf16, one dense weight of 64 elements and one expert weight of
    4 experts x 16 (32 per ep rank), buckets large: the host holds 16 + 2 bytes per owned element
    of each buffer (64 / 4 dense, 32 / 2 experts) and a step counter per buffer; the device the
    bf16 parameters and fp32 gradients of both, and no master or moment."""
    got = layout_model_state_bytes([(64,), (4, 16)], [False, True], ep=2, shards=4, stage=1, dtype="bf16",
                                   bucket_numel=10 ** 6, offload=True)
    assert got.offloaded == 64 // 4 + 32 // 2
    assert got.host == 18 * (64 // 4 + 32 // 2) + 2 * 4
    assert (got.params, got.grads, got.master, got.optimizer) == (2 * (64 + 32), 4 * (64 + 32), 0, 0)
