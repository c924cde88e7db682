"""Dry run: the layout, groups, stages and per-rank model-state memory, without a process."""

import pytest
import torch

from tests.support.harness import dims_for, run_ranks
from tests.support.runs import configure
from trainer3d import train
from trainer3d.config.schema import Config
from trainer3d.memory.states import engine_model_state_bytes
from trainer3d.memory.states import rank_parameter_shapes
from trainer3d.config.validate import validate


def test_dry_run_of_512_ranks_prints_every_rank_and_the_memory_without_processes(tmp_path, capsys):
    """The entry point's ``run`` in this process, on the config Hydra composes for that command line
    (as tests/integration/test_runlock.py's checkpoint.dir test): nothing is launched, so nothing
    of the dry run needs an interpreter of its own."""
    cfg = configure(tmp_path / "run", ["dry_run=true", "model=70b", "parallel=single", "parallel.pp=8",
                                       "parallel.dp=64", "parallel.zero_stage=1", "train.dtype=bf16",
                                       "train.micro_batch_size=1", "train.global_batch_size=512"])
    assert train.run(cfg) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "run" / "submitit").exists(), "a dry run launches nothing"
    assert "layout: tp=1 x pp=8 x dp=64 = 512 ranks, zero_stage=1" in out
    assert "8 dp groups of 64: [0,1,...,63] [64,65,...,127]" in out
    assert "64 pp groups of 8: [0,64,128,192,256,320,384,448]" in out
    lines = out.splitlines()
    rows = [line.split() for line in lines[lines.index("rank     pp    dp    tp") + 1:]]
    assert [int(r[0]) for r in rows] == list(range(512))
    assert rows[511][1:] == ["7", "63", "0"] and rows[65][1:] == ["1", "1", "0"]
    assert "stage 7 (pp rank 7): layers 70-79" in out
    # Rank 0 of the first stage: embedding + 10 layers of the 70b model (8,818,688,000 parameters).
    assert " 0   8,818,688,000 " in out
    # 1F1B: the first stage holds all 8 micro-batches in flight, the last one; the worst is named
    flight = next(line for line in lines if "micro-batches in flight" in line).split()
    assert flight[-8:] == ["8", "7", "6", "5", "4", "3", "2", "1"]  # pp ranks 0 .. 7
    assert "worst: pp rank 0 (global ranks 0..63)" in out


def _cfg(tie_embeddings=False, **parallel) -> Config:
    cfg = Config()
    cfg.model.tie_embeddings = tie_embeddings
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 16, None
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return validate(cfg)


def _real_shapes(rank, world, cfg):
    """The parameters the rank holds, in registration order; one that two chunks share (a V's
    tied embedding) once."""
    from trainer3d.parallel.parallelize import build_model_chunks
    dims = dims_for(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp)
    held = {}
    for chunk in build_model_chunks(cfg, dims):
        for p in chunk.parameters():
            held.setdefault(p, tuple(p.shape))
    return list(held.values())


@pytest.mark.parametrize("layout", [dict(pp=2, dp=1), dict(pp=2, dp=1, pp_layers=[3, 1]),
                                    dict(pp=2, dp=1, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
                                    dict(pp=2, dp=1, tp=2, tie_embeddings=True),
                                    dict(pp=2, dp=1, pp_schedule="zbv", pp_virtual_stages=2, tie_embeddings=True)],
                         ids=["pp2", "pp2-uneven", "pp2-interleaved", "tp2-pp2-tied", "pp2-zbv-tied"])
def test_planned_shapes_are_the_ranks_real_shapes(layout):
    cfg = _cfg(**layout)
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    real = run_ranks(_real_shapes, world, cfg, timeout=120)
    assert [rank_parameter_shapes(cfg, r) for r in range(world)] == real


def test_dry_run_peak_is_the_accounting_the_planner_uses():
    from trainer3d.memory.dry_run import peak_lines
    from trainer3d.memory.peak import rank_memory

    cfg = _cfg(tp=2, pp=2, dp=1, sequence_parallel=True)
    lines = peak_lines(cfg)
    total = next(line for line in lines if line.strip().startswith("step peak ("))
    mems = [rank_memory(cfg, r) for r in range(2)]
    assert total.split()[-4:] == [f"{mems[0].step_total / 2 ** 20:.1f}", "MiB",
                                  f"{mems[1].step_total / 2 ** 20:.1f}", "MiB"]
    worst = max(mems, key=lambda m: m.total)
    assert f"worst: pp rank {worst.pp_rank}" in lines[-1]
    # the first stage's activations: 2 micro-batches in flight of the per-micro-batch formula
    assert mems[0].in_flight == [2] and mems[1].in_flight == [1]


def test_planned_memory_is_the_engine_accounting_of_those_shapes():
    from trainer3d.memory.dry_run import memory_lines
    cfg = _cfg(pp=2, dp=4, zero_stage=1)
    shapes = rank_parameter_shapes(cfg, 0)
    engine = engine_model_state_bytes(shapes, 4, 1, "fp32", int(cfg.parallel.bucket_mb * 2 ** 20) // 4)
    line = memory_lines(cfg)[2].split()
    assert int(line[1].replace(",", "")) == sum(torch.Size(s).numel() for s in shapes)
    assert line[2] == f"{engine.total / 2 ** 20:.1f}"
