"""Optimizer offload on a CUDA device (parallel.offload_optimizer, parallel/zero/offload.py): the
fp32 masters and AdamW moments leave the device's memory, the gradients go to pinned host
memory on a side stream while backward runs, and training follows the run without offload.
ZeRO-3 offload (parallel/zero/fsdp_offload.py, FSDP2's CPUOffloadPolicy): the fp32 parameter
shards, their gradients and the moments leave the device, and training follows the run without it.

Marked ``gpu``; skips without a CUDA device (run ``pytest -m gpu tests/gpu`` on a GPU machine).
"""

import gc
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.runs import PARITY, losses, run_train
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.parallel.topology import ParallelDims, Topology
from trainer3d.parallel.zero.fsdp_offload import OffloadedFSDPOptimizer
from trainer3d.parallel.zero.offload import OffloadedOptimizer
from trainer3d.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "needs one; run `pytest -m gpu` on a GPU machine)")]

CUDA = ("parallel=single", "train.device=cuda")


def _config(run_dir, offload: bool, stage: int = 0) -> Config:
    cfg = Config(run_dir=str(run_dir))
    cfg.parallel.zero_stage = stage
    cfg.train.device, cfg.train.dtype, cfg.train.max_steps, cfg.train.log_every = "cuda", "bf16", 4, 1
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 8, None
    cfg.train.seq_len, cfg.train.eval_every, cfg.checkpoint.every = 64, 0, 0
    cfg.parallel.offload_optimizer = offload
    return validate(cfg)


def _device_bytes(run_dir, offload: bool):
    """(bytes the built trainer holds on the device, the most it holds in 4 steps, flat numel,
    the optimizer), each relative to the allocations before it was built."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), torch.device("cuda"))
    trainer = Trainer(_config(run_dir, offload), dims)
    built = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() - before
    numel, kind = trainer.optimizer.buffers.numel, type(trainer.optimizer)
    del trainer
    return built, peak, numel, kind


@pytest.fixture
def one_nccl_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fp32_states_leave_the_device(tmp_path, one_nccl_rank):
    """bf16, ZeRO-0 on one GPU: the device holds 12 bytes per parameter less with offload —
    the fp32 master (4) and the two moments (8) — once built and at the peak of training
    (the step allocates nothing model-sized either way); the flat bf16 parameters and fp32
    gradients stay."""
    plain_built, plain_peak, numel, plain_kind = _device_bytes(tmp_path / "plain", offload=False)
    off_built, off_peak, off_numel, off_kind = _device_bytes(tmp_path / "offload", offload=True)
    assert off_kind is OffloadedOptimizer and plain_kind is not OffloadedOptimizer and numel == off_numel
    states = 12 * numel  # about 10 MB on the tiny model
    assert plain_built - off_built == pytest.approx(states, rel=0.01), (plain_built, off_built)
    assert plain_peak - off_peak == pytest.approx(states, rel=0.05), (plain_peak, off_peak)
    assert off_built >= (2 + 4) * numel  # the parameters and the gradient buffer are still there


@pytest.mark.parametrize("layout", [["parallel.bucket_mb=0.05"], ["parallel.zero_stage=3"]],
                         ids=["zero1-pinned-side-stream", "zero3-fsdp2-shards"])
def test_offloaded_losses_follow_the_device_step(tmp_path, layout):
    """The real entry point on CUDA, one GPU: 20 bf16 steps with offload (ZeRO-0/1: pinned
    buffers, the side stream; ZeRO-3: FSDP2's shards on the host) within bf16's rounding of the
    same run without it."""
    base = [*PARITY, *CUDA, "train.dtype=bf16", *layout]
    plain = losses(tmp_path / "plain", base)
    offloaded = losses(tmp_path / "offload", [*base, "parallel.offload_optimizer=true"])
    np.testing.assert_allclose(offloaded, plain, rtol=1e-3)


def test_gradient_copies_run_on_a_side_stream_during_backward(tmp_path):
    """A profiled step: the device-to-host copies of the gradients run on a stream of their own,
    and at least one of them overlaps a kernel of the compute stream (backward going on)."""
    run_train(tmp_path / "run", [*CUDA, *PARITY, "train.dtype=bf16", "parallel.bucket_mb=0.05",
                                 "model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4",
                                 "model.ffn_dim=1536", "parallel.offload_optimizer=true", "train.profile=[2,4]"])
    events = json.loads((tmp_path / "run" / "profile" / "trace_rank0.json").read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert copies and kernels
    compute_streams = {k["args"]["stream"] for k in kernels}
    side = [c for c in copies if c["args"]["stream"] not in compute_streams]
    assert side, "the gradient copies should run on a stream without compute kernels"

    def overlaps(a, b):
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
    assert any(overlaps(c, k) for c in side for k in kernels), "no gradient copy overlapped a kernel"


def _fsdp_device_bytes(run_dir, offload: bool):
    """As ``_device_bytes`` for ZeRO-3 on one GPU (FSDP2 over a mesh of one: the shard is the
    whole model): (built, peak, parameters, optimizer type, host shards' devices)."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), torch.device("cuda"))
    trainer = Trainer(_config(run_dir, offload, stage=3), dims)
    built = torch.cuda.memory_allocated() - before
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() - before
    opt = trainer.optimizer
    numel, kind = sum(p.numel() for p in opt.params), type(opt)
    where = {t.device.type for t in (*opt.local, *opt.exp_avg, opt.step_count)}
    pinned = all(t.is_pinned() for t in opt.local) and all(p.grad is None or p.grad.to_local().is_pinned()
                                                           for p in opt.params)
    del trainer, opt
    return built, peak, numel, kind, where, pinned


def test_zero3_shards_leave_the_device(tmp_path, one_nccl_rank):
    """bf16 ZeRO-3 on one GPU: with offload the fp32 parameter shard (4 bytes per parameter) and
    the moments (8) are not on the device once built, and at the training peak the device
    holds at least those 12 and at most the 16 with the gradient shard less (what is in flight,
    a block's shard copied up and its gradient before the copy down, stays); the shards are
    pinned host memory."""
    plain_built, plain_peak, numel, plain_kind, plain_where, _ = _fsdp_device_bytes(tmp_path / "plain", False)
    off_built, off_peak, off_numel, off_kind, off_where, pinned = _fsdp_device_bytes(tmp_path / "offload", True)
    assert off_kind is OffloadedFSDPOptimizer and plain_kind is not OffloadedFSDPOptimizer and numel == off_numel
    assert plain_where == {"cuda"} and off_where == {"cpu"} and pinned
    assert plain_built - off_built == pytest.approx(12 * numel, rel=0.01), (plain_built, off_built)
    assert 12 * numel <= plain_peak - off_peak <= 16.5 * numel, (plain_peak, off_peak, numel)


def test_a_large_pinned_buffer_takes_the_bytes_it_asks_for():
    """In a fresh process: after ``exact_pinned_sizes`` (what every CUDA rank runs first,
    trainer3d/rank/body.py) torch's host allocator gives a 65 MiB + 4 KiB pinned buffer that many
    bytes, not the next power of two (128 MiB) it gives without."""
    import subprocess
    import sys
    size = 65 * 2 ** 20 + 4096
    code = ("import sys, torch; from trainer3d.config.device import exact_pinned_sizes; "
            "changed = sys.argv[1] == 'exact' and exact_pinned_sizes(); torch.cuda.init(); "
            f"t = torch.empty({size}, dtype=torch.uint8, pin_memory=True); "
            "print(changed, torch.cuda.host_memory_stats()['allocated_bytes.current'])")
    got, changed = {}, {}
    for mode in ("exact", "rounded"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        changed[mode], got[mode] = out.stdout.split()[-2] == "True", int(out.stdout.split()[-1])
    if not changed["exact"]:  # torch 2.11 refuses the key: its allocator keeps rounding
        assert got == {"exact": 128 * 2 ** 20, "rounded": 128 * 2 ** 20}, got
        pytest.skip(f"torch {torch.__version__} has no pinned_max_round_threshold_mb: pinned buffers round up")
    assert got == {"exact": size, "rounded": 128 * 2 ** 20}, got
