"""The host copy a background save stages (checkpoint.async_save) is counted exactly: the
bytes of the saver's own staging buffers after a save (trainer3d/checkpoint/staging.py,
``Staging.bytes``) against trainer3d/memory/staged.py's count, on every rank of three layouts
that each exercise one rule: ZeRO-1's owned slices with bucket padding and a bf16 master,
ZeRO-3's uneven row shards, a pipeline's tied embedding (staged by the first stage only)
under fp16's loss scaler.
"""

import pytest

from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.memory.staged import staged_bytes
from trainer3d.trainer import Trainer

LAYOUTS = {
    "zero1-bf16-padded": dict(dp=2, zero_stage=1, dtype="bf16", bucket_mb=0.01, tie=False),
    "zero3-fp32": dict(dp=2, zero_stage=3, dtype="fp32", bucket_mb=25.0, tie=False),
    "pp2-tied-fp16": dict(pp=2, zero_stage=0, dtype="fp16", bucket_mb=25.0, tie=True),
}


def _cfg(root: str, layout: dict) -> Config:
    cfg = Config(run_dir=root)
    p = cfg.parallel
    p.dp, p.pp, p.zero_stage, p.bucket_mb, p.timeout_s = (layout.get("dp", 1), layout.get("pp", 1),
                                                          layout["zero_stage"], layout["bucket_mb"], 60)
    cfg.model.n_layers, cfg.model.tie_embeddings, cfg.model.vocab_size = 2, layout["tie"], 257  # odd rows
    cfg.train.dtype, cfg.train.seq_len, cfg.train.resume, cfg.train.max_steps = layout["dtype"], 16, "never", 1
    cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.train.global_batch_size = 1, 2, None
    cfg.logger.mode, cfg.checkpoint.async_save, cfg.checkpoint.every = "disabled", True, 1  # saves in the background
    return validate(cfg)


def _staged(rank: int, world: int, root: str, name: str) -> dict:
    layout = LAYOUTS[name]
    cfg = _cfg(root, layout)
    dims = dims_for(pp=cfg.parallel.pp, dp=cfg.parallel.dp, tied_embeddings=cfg.model.tie_embeddings)
    trainer = Trainer(cfg, dims)
    trainer.checkpointer.save(0, background=True)
    trainer.checkpointer.wait("the test's end")
    return {"measured": trainer.checkpointer.staging.bytes, "pp_rank": dims.pp_rank, "dp_rank": dims.dp_cp_rank}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_counted_staging_is_what_the_saver_stages(tmp_path, name):
    results = run_ranks(_staged, 2, str(tmp_path), name, timeout=600)
    cfg = _cfg(str(tmp_path), LAYOUTS[name])
    counted = [staged_bytes(cfg, r["pp_rank"], r["dp_rank"]) for r in results]
    assert [r["measured"] for r in results] == counted, (results, counted)
    assert all(r["measured"] > 0 for r in results)
