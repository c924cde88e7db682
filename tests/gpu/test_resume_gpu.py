"""Resuming on CUDA (bf16, and fp32 with offload): the loaded state is bit for bit what the
saver held, wherever it lives — the device, or host memory for an offloaded optimizer
(parallel/zero/offload.py, fsdp_offload.py) — and the resumed steps follow the uninterrupted
run. A save in the loop
copies no host state onto the device, and a background save opens no CUDA context on
another rank's GPU (trainer3d/checkpoint/state.py and saver.py say why either could).

One GPU is one NCCL rank: the resume tests run one rank in this process (ZeRO-1 with dp 1
keeps the flat optimizer, ZeRO-3 FSDP2 over a mesh of one); the context test needs two GPUs
and skips below. Marked ``gpu``; skips without a CUDA device (``pytest -m gpu tests/gpu``).
"""

import gc
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.runs import read_metrics
from trainer3d.checkpoint import store
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.launch.local_ranks import run_ranks
from trainer3d.memory.staged import staged_bytes
from trainer3d.parallel.topology import ParallelDims, Topology
from trainer3d.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the gpu tier "
                                 "needs one; run `pytest -m gpu` on a GPU machine)")]

STEPS, SAVE_AT = 8, 4
LAYOUTS = {"zero1": (1, False, "bf16"), "zero1-offload": (1, True, "bf16"), "zero3": (3, False, "bf16"),
           "zero3-offload": (3, True, "bf16"), "zero1-offload-fp32": (1, True, "fp32"),
           "zero3-offload-fp32": (3, True, "fp32")}
"""name -> (parallel.zero_stage, parallel.offload_optimizer, train.dtype)."""
RESUME_RTOL = {"bf16": 1e-3, "fp32": 1e-5}
"""The resumed steps against the uninterrupted run, as tests/multirank/test_offload.py holds
resumes: the state is checked bit for bit at the load; a lost master (zero weights) or
reset moments move the next losses by far more."""


def _config(run_dir, stage: int, offload: bool, steps: int, resume: str = "never", async_save: bool = False,
            every: int = SAVE_AT, dp: int = 1, dtype: str = "bf16") -> Config:
    cfg = Config(run_dir=str(run_dir))
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.parallel.offload_optimizer = dp, stage, offload
    t = cfg.train
    t.device, t.dtype, t.max_steps, t.log_every, t.resume, t.eval_every = "cuda", dtype, steps, 1, resume, 0
    t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, t.seq_len = 2, 8 * dp, None, 64
    cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.async_save = every, 4, async_save
    return validate(cfg)


def _state(optimizer) -> dict:
    """This rank's checkpointed tensors by kind, name and range, as host fp32 arrays."""
    return {f"{kind} {v.name} {v.start}": t.detach().float().cpu().numpy().copy()
            for v in optimizer.checkpoint_views() for kind, t in v.tensors.items()}


def _host_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for v in optimizer.checkpoint_views()
               for t in v.tensors.values() if t.device.type == "cpu")


@pytest.fixture
def one_nccl_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _train(run_dir, stage, offload, steps, resume="never", async_save=False, dtype="bf16"):
    """(state as built or loaded, the trainer after training, its losses by step)."""
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=1), torch.device("cuda", 0))
    trainer = Trainer(_config(run_dir, stage, offload, steps, resume, async_save, dtype=dtype), dims)
    loaded = _state(trainer.optimizer)
    trainer.train()
    return loaded, trainer, {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def _resumed_steps(resumed: dict, full: dict, dtype: str = "bf16") -> None:
    assert sorted(resumed) == list(range(SAVE_AT, STEPS))
    np.testing.assert_allclose([resumed[s] for s in range(SAVE_AT, STEPS)],
                               [full[s] for s in range(SAVE_AT, STEPS)], rtol=RESUME_RTOL[dtype])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_restores_every_state_where_it_lives(tmp_path, one_nccl_rank, layout):
    """Saved at step 4 (the final save, written in the loop) and resumed to 8: parameters,
    fp32 masters (ZeRO-1; ZeRO-3's fp32 shards are the masters) and both moments load bit
    for bit, host or device, and the resumed losses follow the uninterrupted run's."""
    stage, offload, dtype = LAYOUTS[layout]
    _, saver, _ = _train(tmp_path / "saver", stage, offload, SAVE_AT, dtype=dtype)
    at_save = _state(saver.optimizer)
    if offload:
        assert _host_bytes(saver.optimizer) > 0  # the layout really keeps state on the host
    del saver
    gc.collect()
    _, full, full_losses = _train(tmp_path / "full", stage, offload, STEPS, dtype=dtype)
    del full
    saved = store.step_dir(tmp_path / "saver" / "checkpoints", SAVE_AT)
    loaded, resumed, resumed_losses = _train(tmp_path / "resumed", stage, offload, STEPS, resume=str(saved),
                                             dtype=dtype)
    del resumed
    assert loaded.keys() == at_save.keys()
    assert any(k.startswith("master ") for k in loaded) == (stage == 1 and dtype == "bf16")
    for key, value in at_save.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    _resumed_steps(resumed_losses, full_losses, dtype)


def test_resume_from_a_save_written_in_the_background(tmp_path, one_nccl_rank):
    """ZeRO-1 offload, checkpoint.async_save: the step-4 save is staged (device parameters to
    pinned buffers, host state to host buffers) and written while steps 5-8 run; resuming
    from it repeats the same steps 4-8."""
    _, run, losses = _train(tmp_path / "run", 1, True, STEPS, async_save=True)
    del run
    saved = store.step_dir(tmp_path / "run" / "checkpoints", SAVE_AT)
    assert saved.is_dir()
    _, resumed, resumed_losses = _train(tmp_path / "resumed", 1, True, STEPS, resume=str(saved))
    del resumed
    _resumed_steps(resumed_losses, losses)


@pytest.mark.parametrize("layout", ["zero1-offload", "zero3-offload"])
def test_a_save_in_the_loop_copies_no_host_state_to_the_device(tmp_path, one_nccl_rank, layout):
    """The final and stop saves are written from the live tensors: the host masters and moments
    are written from host memory, so the device's peak during the save grows by far less than
    them (a piece wrapped on the device mesh would put a copy of all of them there at once)."""
    stage, offload, dtype = LAYOUTS[layout]
    _, trainer, _ = _train(tmp_path / "run", stage, offload, 2, dtype=dtype)
    host = _host_bytes(trainer.optimizer)
    assert host > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.checkpointer.save(3, background=False)
    grown = torch.cuda.max_memory_allocated() - before
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir()
    assert grown < host / 10, (grown, host)


def _contexts_after_background_saves(rank: int, world: int, run_dir: str) -> list:
    """Train dp=world on NCCL (one GPU per rank) with background saves at steps 2 and 4; then
    which GPUs this process holds a CUDA context on."""
    dist.destroy_process_group()  # the harness's gloo group: this run is NCCL's
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{run_dir}/nccl-store", rank=rank, world_size=world,
                            device_id=device)
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=world), device)
    cfg = _config(os.path.join(run_dir, "run"), 1, False, 6, async_save=True, every=2, dp=world)
    trainer = Trainer(cfg, dims)
    trainer.train()
    published = [step for step, _ in store.published(trainer.checkpointer.root)]
    return published, [torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count())]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a context on another rank's GPU needs two GPUs to show")
def test_a_background_save_opens_no_context_on_another_gpu(tmp_path):
    """Two NCCL ranks, each on its own GPU, save in the background (DCP's writer takes the
    current device's stream in the save thread): each process holds a CUDA context on its own
    GPU and on no other (the driver's primary context state, read without creating one by
    ``torch._C._cuda_hasPrimaryContext``, as torch's own test/test_cuda_primary_ctx.py does)."""
    for rank, (published, contexts) in enumerate(run_ranks(_contexts_after_background_saves, 2, str(tmp_path),
                                                           timeout=600)):
        assert {2, 4} <= set(published), published
        assert contexts[:2] == [rank == 0, rank == 1], (rank, contexts)
        assert not any(contexts[2:]), (rank, contexts)


@pytest.mark.parametrize("layout", ["zero1", "zero1-offload", "zero3"])
def test_the_pinned_staging_of_a_background_save_is_counted(tmp_path, one_nccl_rank, layout):
    """On CUDA a background save stages into pinned host buffers: their bytes are what
    trainer3d/memory/staged.py counts for the memory check (CPU ranks: tests/multirank/
    test_staged_bytes.py), wherever the live state is (device, or host when offloaded)."""
    stage, offload, dtype = LAYOUTS[layout]
    cfg = _config(tmp_path / "run", stage, offload, 2, async_save=True, every=2, dtype=dtype)
    trainer = Trainer(cfg, ParallelDims.build(Topology(tp=1, pp=1, dp=1), torch.device("cuda", 0)))
    trainer.train()
    staging = trainer.checkpointer.staging
    assert staging.pinned and all(b.is_pinned() for b in staging.buffers.values())
    assert staging.bytes == staged_bytes(cfg, 0) > 0
