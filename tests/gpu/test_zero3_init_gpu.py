"""ZeRO-3 start-up on a CUDA device: the model is built on the meta device, sharded, and only
this rank's shards are allocated and filled (trainer3d/parallel/parallelize.py,
parallel/zero/fsdp.py ``shard_and_materialise``), so the device's peak while the model and the
optimizer are built stays at the formula's start-up figure — the fp32 shards and Adam's two
moments, 12 bytes per parameter (over one rank: the whole model's shards); each parameter's
rows are drawn on the host and copied straight into its shard. Checked against a
hand count of the parameters and torch.cuda.max_memory_allocated, and against the dry run's
start-up term (trainer3d/memory/startup.py).

Marked ``gpu``; skips without a CUDA device (run ``pytest -m gpu tests/gpu`` on a GPU machine).
The CPU tier holds the same mechanism on four gloo ranks: tests/multirank/test_zero3_init.py.
"""

import copy
import gc

import pytest
import torch
import torch.distributed as dist

from tests.support.zero_ranks import make_cfg
from trainer3d.config.schema import ModelConfig
from trainer3d.parallel.topology import ParallelDims, Topology

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "needs one; run `pytest -m gpu` on a GPU machine)")]

MODEL = ModelConfig(dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, ffn_dim=2816, vocab_size=32000, max_seq_len=64)
BLOCK = 4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024  # wq wk wv wo, w1 w2 w3, two norms (hand count)
PARAMS = 8 * BLOCK + 2 * 32000 * 1024 + 1024  # blocks, embedding and untied head, final norm (~166M)


@pytest.fixture
def one_nccl_rank(tmp_path, monkeypatch):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("stage", [3, 2])
def test_zero_startup_peak_on_the_device_is_the_formulas(one_nccl_rank, stage):
    from trainer3d.memory.peak import rank_memory
    from trainer3d.parallel.parallelize import build_model_chunks, build_optimizer
    cfg = make_cfg(1, stage)
    cfg.model = copy.deepcopy(MODEL)
    cfg.train.device = "cuda"
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), torch.device("cuda"))
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    peak = torch.cuda.max_memory_allocated() - before
    assert sum(p.numel() for p in optimizer.parameters()) == PARAMS
    assert peak <= 16 * PARAMS, f"{peak / 2**20:.1f} MiB at start-up, above the formula's 16 B x {PARAMS}"
    assert peak <= 12 * PARAMS + (1 << 20), f"{peak / 2**20:.1f} MiB at start-up: more than shards and moments"
    estimate = rank_memory(cfg, 0).startup
    assert abs(peak - estimate) <= 1 << 20, (peak, estimate)  # the allocator rounds each block to 512 bytes
