"""Optimizer offload in the accounting and the planner (parallel.offload_optimizer): the host
bytes and the device bytes by hand, the step's offload term by hand, and the search proposing
offload exactly where it is what makes a layout fit (the device's memory and the node's host
memory both checked)."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
from trainer3d.config.schema import Config
from trainer3d.memory.states import ModelStateBytes, engine_model_state_bytes
from trainer3d.plan.devices import device_for
from trainer3d.plan.search import command, evaluate, host_link, search
from trainer3d.plan.step_time import HostLink, offload_s
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
