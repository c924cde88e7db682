"""ZeRO-2/3 start-up: each rank builds on the meta device, shards, then materialises and
initialises only its own shards (trainer3d/parallel/parallelize.py, parallel/zero/fsdp.py).

- The per-rank start-up peak (build + optimizer, resident memory over what the rank held
  before) stays below the ZeRO formula, 16 bytes per parameter / dp, plus one block's fp32
  parameters: a rank that builds the whole fp32 model first holds 4 bytes per parameter
  beside its shards (dp = 4: 16/dp + 4 bytes per parameter).
- The same bound-free figure is held to the dry run's own start-up term (trainer3d/memory/peak.py).
- The initial values are the 1-rank model's, bit for bit, over dp and tp x dp, offloaded too.

Resident memory is read from /proc/self/status (VmHWM, reset through /proc/self/clear_refs
"5": Documentation/filesystems/proc.rst of the Linux kernel), as the issue's author measured.
"""

import copy
import gc
from pathlib import Path

import pytest
import torch

from tests.support.harness import dims_for, run_ranks
from tests.support.zero_ranks import _single_dims, make_cfg
from trainer3d.config.schema import ModelConfig

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")

# 12 small blocks: one block is a small part of the model, so a whole-model build stands out
MODEL = ModelConfig(dim=256, n_layers=12, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=4096, max_seq_len=32)
BLOCK = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256  # wq wk wv wo, w1 w2 w3, two norms (hand count)
PARAMS = 12 * BLOCK + 2 * 4096 * 256 + 256  # blocks, embedding and untied head, final norm


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _startup_peak(rank, world, stage, offload):
    """Resident bytes the build and the optimizer add at their peak on this rank."""
    from trainer3d.parallel.parallelize import build_model_chunks, build_optimizer
    cfg = make_cfg(world, stage)
    cfg.parallel.offload_optimizer = offload
    dims = dims_for(dp=world)
    build_optimizer(build_model_chunks(cfg, dims), cfg, dims)  # the code paths once, on the tiny model
    cfg.model = copy.deepcopy(MODEL)
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    chunks = build_model_chunks(cfg, dims)
    optimizer = build_optimizer(chunks, cfg, dims)
    peak = _status("VmHWM") - before
    return peak, sum(p.numel() for p in optimizer.parameters())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_zero3_startup_peak_is_the_shards(offload):
    results = run_ranks(_startup_peak, 4, 3, offload, timeout=240)
    bound = 16 * PARAMS // 4 + 4 * BLOCK
    for rank, (peak, params) in enumerate(results):
        assert params == PARAMS
        assert peak < bound, (f"rank {rank}: start-up peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB "
                              f"(16 B x {PARAMS} / 4 + one block's fp32)")
