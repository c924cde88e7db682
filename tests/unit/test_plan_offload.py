"""Optimizer offload in the accounting and the planner (parallel.offload_optimizer): the host
bytes and the device bytes by hand, the step's offload term by hand, and the search proposing
offload exactly where it is what makes a layout fit (the device's memory and the node's host
memory both checked)."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.schema import Config
from trainer3d.memory.states import ModelStateBytes, engine_model_state_bytes
from trainer3d.plan.devices import device_for
from trainer3d.plan.search import command, evaluate, host_link, search
from trainer3d.plan.micro_batch_time import RankTimes
from trainer3d.plan.offload_cost import HostLink, fsdp_offload_s, offload_s
from trainer3d.config.validate import validate

SHAPES, DP = [(64, 32), (32,), (128, 32)], 4  # 6,176 elements: no padding at dp 4, one bucket


@pytest.mark.parametrize("dtype,b", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
@pytest.mark.parametrize("stage", [0, 1])
def test_offloaded_state_is_host_memory(stage, dtype, b):
    psi = 6176
    owned = psi // DP if stage == 1 else psi
    got = engine_model_state_bytes(SHAPES, DP, stage, dtype, bucket_numel=10 ** 6, offload=True)
    # device: the parameters in train.dtype, the fp32 gradient buckets, fp16's four scaler scalars
    assert (got.params, got.grads, got.master, got.optimizer) == (b * psi, 4 * psi, 0, 16 if dtype == "fp16" else 0)
    # host: fp32 master + exp_avg + exp_avg_sq + gradient copy, the cast on its way back, the step counter
    assert got.host == (4 + 4 + 4 + 4 + (b if b == 2 else 0)) * owned + 4
    assert got.offloaded == owned
    plain = engine_model_state_bytes(SHAPES, DP, stage, dtype, bucket_numel=10 ** 6)
    assert plain.host == 0 and plain.total - got.total == plain.master + plain.optimizer - got.optimizer


@pytest.mark.parametrize("dtype,b", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_fsdp_shards_are_host_memory(stage, dtype, b):
    """ZeRO-2/3 (FSDP2's CPUOffloadPolicy): the host holds this rank's fp32 parameter shard, its
    gradient shard and both moments (16 bytes per element of the shard) and the step counter;
    the device only ZeRO-2's gathered compute-dtype parameters and fp16's scaler."""
    psi = 6176
    shard = psi // DP
    got = engine_model_state_bytes(SHAPES, DP, stage, dtype, bucket_numel=10 ** 6, offload=True)
    assert (got.params, got.grads, got.master, got.optimizer) == (0, 0, 0, 16 if dtype == "fp16" else 0)
    assert got.gathered == (b * psi if stage == 2 else 0)
    assert got.host == (4 + 4 + 4 + 4) * shard + 4
    assert got.offloaded == got.sharded == shard
    plain = engine_model_state_bytes(SHAPES, DP, stage, dtype, bucket_numel=10 ** 6)
    assert plain.total - got.total == plain.params + plain.grads + plain.optimizer - got.optimizer == got.host


def test_fsdp_offload_time_by_hand():
    """ZeRO-3, 10^9 elements of shard, 4 micro-batches of 1 s forward and 2 s backward, 8 ranks
    sharing 200 GB/s of host memory, 25 GB/s PCIe: the shard's copies up (4 GB twice a
    micro-batch, 0.32 s) hide behind the compute; the first micro-batch's gradient copy down
    (0.16 s) behind its backward; the other three copies down and the host sums (12 GB over
    25 GB/s each) do not; then the host AdamW, 32 bytes an element."""
    cfg = Config()
    cfg.parallel.zero_stage, cfg.train.grad_accum_steps = 3, 4
    states = ModelStateBytes(params=0, grads=0, master=0, optimizer=0, offloaded=10 ** 9, sharded=10 ** 9)
    link = HostLink(pcie_gbps=25.0, host_gbps=200.0)
    times = RankTimes(forward=1.0, backward=2.0, tp_comm=0.0)
    host = 200e9 / 8
    want = 3 * (4e9 / 25e9 + 12e9 / host) + 32e9 / host
    assert fsdp_offload_s(cfg, states, times, 8, link) == pytest.approx(want)
    # compute shorter than the copies: the rest is exposed, every micro-batch
    quick = RankTimes(forward=0.1, backward=0.1, tp_comm=0.0)
    exposed = 4 * (8e9 / 25e9 - 0.2) + (4e9 / 25e9 - 0.1)
    assert fsdp_offload_s(cfg, states, quick, 8, link) == pytest.approx(exposed + want)
    assert fsdp_offload_s(cfg, dataclasses.replace(states, offloaded=0), times, 8, link) == 0.0


def test_offload_time_by_hand():
    """10^9 owned bf16 elements, 4 GB of fp32 gradients in 25 MiB buckets, a 10 s backward, 8
    ranks sharing 200 GB/s of host memory, 25 GB/s PCIe: the copy out hides but for its last
    bucket, the host AdamW reads and writes 32 bytes an element plus the bf16 cast (4 + 2),
    the copy back is 2 bytes an element."""
    cfg = Config()
    cfg.train.dtype, cfg.parallel.bucket_mb = "bf16", 25.0
    states = ModelStateBytes(params=2 * 10 ** 9, grads=4 * 10 ** 9, master=0, optimizer=0, offloaded=10 ** 9)
    to_host = 4e9 / 25e9
    last_bucket = to_host * 25 * 2 ** 20 / 4e9
    host_step = (32 + 6) * 1e9 / (200e9 / 8)
    back = 2e9 / 25e9
    got = offload_s(cfg, states, 10.0, 8, HostLink(pcie_gbps=25.0, host_gbps=200.0))
    assert got == pytest.approx(last_bucket + host_step + back)
    # a backward shorter than the copy leaves the rest exposed
    short = offload_s(cfg, states, 0.05, 8, HostLink(pcie_gbps=25.0, host_gbps=200.0))
    assert short == pytest.approx(last_bucket + (to_host - last_bucket - 0.05) + host_step + back)
    assert offload_s(cfg, dataclasses.replace(states, offloaded=0), 10.0, 8, HostLink()) == 0.0


def _plan(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("plan", [
            "model=13b", "cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=a100-40g",
            "train.global_batch_size=32", "train.seq_len=2048", "search.micro_batch_sizes=[1]",
            "search.zero_stages=[1]", "search.virtual_stages=[1]", "search.sequence_parallel=[true]",
            "search.recompute=[false]", *overrides]))


def test_search_proposes_offload_where_it_makes_the_layout_fit():
    """13B on 8 x 40 GB with ZeRO-1: tp2 x pp2 x dp2 holds 3.25B parameters per rank (58 GB of
    model states at 18 bytes each) and fits only with its 12 bytes/parameter of masters and
    moments on the host; the plan's command says so."""
    cfg, device = _plan(), device_for("a100-40g")
    usable = device.usable_bytes(8)
    found = {(p.cfg.parallel.tp, p.cfg.parallel.pp, p.cfg.parallel.dp): p for p in search(cfg, device).plans}
    plan = found[(2, 2, 2)]
    assert plan.cfg.parallel.offload_optimizer and plan.memory.total <= usable
    assert "parallel.offload_optimizer=true" in command(plan.cfg)
    validate(plan.cfg)
    plain = evaluate(dataclasses.replace(plan.cfg, parallel=dataclasses.replace(plan.cfg.parallel,
                                                                                offload_optimizer=False)),
                     device, 8, "nccl", link=host_link(cfg))
    assert plain.memory.total > usable  # without offload it does not fit
    assert plan.step.offload > 0 and plain.step.offload == 0
    without = search(_plan("search.offload=false"), device).plans
    assert (2, 2, 2) not in {(p.cfg.parallel.tp, p.cfg.parallel.pp, p.cfg.parallel.dp) for p in without}
    assert not any(p.cfg.parallel.offload_optimizer for p in without)


def test_offload_that_does_not_fit_the_hosts_memory_is_not_proposed():
    cfg, device = _plan("cluster.host_memory_gb=100"), device_for("a100-40g")
    # the 13B model's host state, 18 bytes per parameter over the node: ~218 GiB > 90 GiB
    assert not any(p.cfg.parallel.offload_optimizer for p in search(cfg, device).plans)


def test_search_proposes_fsdp_offload_where_only_it_fits():
    """13B on one node of 2 x 40 GB: no layout fits the device without offload (ZeRO-3 alone
    keeps 8 bytes per parameter of fp32 shard and gradient, 52 GB a rank; a pipeline or tp
    keeps 6.5B parameters' 6 bytes of bf16 weights and fp32 gradients even offloaded), and
    ZeRO-2/3 with their shards on the host (16 bytes per parameter: 208 GB of the node's
    900 GiB) fit, each plan's command saying so."""
    cfg = _plan("cluster.gpus_per_node=2", "search.zero_stages=[0,1,2,3]", "search.recompute=[true]",
                "search.micro_batch_sizes=[4]")
    device = device_for("a100-40g")
    plans = search(cfg, device).plans
    assert plans and all(p.cfg.parallel.offload_optimizer and p.cfg.parallel.zero_stage >= 2 for p in plans)
    assert {p.cfg.parallel.zero_stage for p in plans} == {2, 3}
    for plan in plans:
        assert "parallel.offload_optimizer=true" in command(plan.cfg) and plan.step.offload > 0
        assert 16 * 13e9 / 2 < plan.host_per_node(2) / 2 < 16.1 * 13e9 / 2
        validate(plan.cfg)
    assert search(_plan("cluster.gpus_per_node=2", "search.zero_stages=[0,1,2,3]", "search.recompute=[true]",
                        "search.micro_batch_sizes=[4]", "search.offload=false"), device).plans == []


def test_one_gpu_trains_13b_only_with_zero3_offload():
    """13B on one 40 GB GPU: ZeRO-0 does not fit even offloaded (6 bytes per parameter of bf16
    weights and fp32 gradients stay: 78 GB), and ZeRO-3 over a dp of one, offloaded, does —
    the planner tries it where ZeRO-0 does not fit (``_offload_tries``), never otherwise."""
    cfg = _plan("cluster.gpus_per_node=1", "search.zero_stages=[0,1,2,3]", "search.recompute=[true]",
                "search.micro_batch_sizes=[8]")
    plans = search(cfg, device_for("a100-40g")).plans
    assert [(p.cfg.parallel.dp, p.cfg.parallel.zero_stage, p.cfg.parallel.offload_optimizer) for p in plans] == [
        (1, 3, True)]
    assert "parallel.zero_stage=3 parallel.offload_optimizer=true" in command(plans[0].cfg)
    validate(plans[0].cfg)
    roomy = search(_plan("cluster.gpus_per_node=1", "cluster.gpu=a100-80g", "search.zero_stages=[0,1,2,3]",
                         "search.recompute=[true]", "search.micro_batch_sizes=[1]", "model=7b"),
                   device_for("a100-80g")).plans
    assert roomy and all(p.cfg.parallel.zero_stage == 0 for p in roomy)  # ZeRO-0 fits offloaded: no ZeRO-3
