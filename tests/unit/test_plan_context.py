"""The planner and context parallelism: which cp degrees it tries, the step-time model's
count of a cp rank's work (a hand count), and its answer for a long sequence."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.model.flops import matmul_params
from trainer3d.plan.devices import Device, device_for
from trainer3d.plan.search import context_parallel_sizes, evaluate, search


def _plan_config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("plan", list(overrides)))


def test_cp_is_tried_from_the_threshold_on():
    assert context_parallel_sizes(_plan_config("train.seq_len=8192"), 32) == [1]
    long = _plan_config("train.seq_len=131072", "model.max_seq_len=131072")
    assert context_parallel_sizes(long, 32) == [1, 2, 4, 8, 16]
    assert context_parallel_sizes(long, 12) == [1, 2, 4]


def _ideal() -> Device:
    """Matmuls at 1 TFLOP/s, everything else free."""
    return Device(name="ideal", memory_gib=80, reserved_gib=0, matmul_tflops={"fp32": 1.0, "bf16": 1.0},
                  memory_gbps=1e12, intra_gbps=1e12, inter_gbps=1e12, latency_us=0.0, source="test")


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_rank_computes_its_share_of_the_tokens_over_the_whole_sequence(cp):
    cfg = Config()
    cfg.model.n_layers = 8
    cfg.parallel.cp = cp
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 16, None
    cfg = validate(cfg)
    m, t = cfg.model, cfg.train
    # each rank: 1/cp of the tokens, each attending causally over all seq_len positions
    flops = 3 * t.global_batch_size * t.seq_len / cp * (2 * matmul_params(m) + m.n_layers * 2 * t.seq_len * m.dim)
    step = evaluate(cfg, _ideal(), 8, "nccl").step
    assert step.compute == pytest.approx(flops / 1e12, rel=1e-9)


def test_long_context_plan_for_llama3_8b_on_64_gpus_uses_cp():
    """Llama-3.1-8B at 131,072 tokens on 8 x 8 H100 (without recomputation, to keep the search
    small): the search proposes cp, the sequence split over a node or less (cp x tp <= 8: the
    ring on NVLink), and it is faster than the best layout without cp."""
    args = ("model=llama3.1-8b", "cluster.nodes=8", "cluster.gpus_per_node=8", "train.global_batch_size=16",
            "train.seq_len=131072", "search.recompute=[false]", "search.micro_batch_sizes=[1,2]",
            "search.virtual_stages=[1]")
    device = device_for("h100-sxm")
    without = search(_plan_config(*args, "search.context_parallel_from=1000000"), device)
    best = search(_plan_config(*args), device).plans[0]
    p = best.cfg.parallel
    assert p.cp > 1 and p.cp * p.tp <= 8
    assert all(plan.cfg.parallel.cp == 1 for plan in without.plans)
    assert not without.plans or best.tokens_per_s > without.plans[0].tokens_per_s


def test_the_ring_hides_its_hops_behind_the_fused_kernels_time_on_gpus():
    """On a GPU preset a hop is exposed where it outlasts one block of torch's fused attention:
    a causal half-square of the local queries on local keys, 2 matmuls x 2 FLOPs x b s^2 heads d / 2,
    at the flash kernel's achieved forward rate at the local length (``flash_rates``: the preset's
    measured table where it has one, else flash_fraction x the data-sheet peak), not the GEMM rate.
    Links made slow enough that every hop is exposed; the hop's time by hand."""
    import dataclasses

    from trainer3d.memory.activations import Sizes
    from trainer3d.plan.micro_batch_time import _cp_exposed

    slow = dataclasses.replace(device_for("h100-sxm"), intra_gbps=1.0, inter_gbps=1.0)
    cfg = Config()
    cfg.model.n_layers, cfg.model.max_seq_len, cfg.parallel.cp, cfg.train.dtype = 2, 4096, 4, "bf16"
    cfg.train.seq_len = 4096
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 1, 1, None
    cfg = validate(cfg)
    z, m = Sizes.of(cfg), cfg.model
    s, d = 4096 // 4, m.dim // m.n_heads
    k = slow.kernels
    block = 2 * 2 * 1 * s * s * m.n_heads * d / 2 / k.flash_rates(s)[0]
    hop = 2 * (2 * s * m.n_kv_heads * d) / 1e9 + slow.latency(8) * 1e-6
    fwd, _ = _cp_exposed(cfg, z, slow, 8)
    assert fwd == pytest.approx(3 * (hop - block), rel=1e-9)
