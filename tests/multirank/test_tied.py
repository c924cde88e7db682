"""Tied input/output embeddings in the engine: one shared Parameter without a pipeline, two
copies kept equal with one (the 3D case runs through the entry point in tests/integration/test_hf.py)."""

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.zero_ranks import build, make_cfg, params_by_name, reference_steps, train_step
from trainer3d.parallel.topology import Topology

STEPS = 3


def test_embedding_groups_are_the_ends_of_each_pipeline():
    topo = Topology(tp=2, pp=3, dp=2)  # 12 ranks: stage 0 = 0-3, stage 1 = 4-7, stage 2 = 8-11
    assert topo.embedding_groups() == [[0, 8], [1, 9], [2, 10], [3, 11]]
    assert topo.embedding_dp_groups() == [[0, 2, 8, 10], [1, 3, 9, 11]]
    assert Topology(tp=2, pp=1, dp=2).embedding_groups() == []


def _tied_against_reference(rank, world):
    out = {}
    for stage in (0, 1, 3):
        cfg = make_cfg(world, stage, bucket_mb=0.01, zero_reduce="reduce_scatter", grad_clip=0.5)
        cfg.model.tie_embeddings = True
        dims, model, opt = build(cfg)
        shared = model.output.weight is model.tok_embeddings.weight
        norms = [train_step(model, opt, cfg, dims.dp_rank, s).item() for s in range(STEPS)]
        out[stage] = ({n: t.numpy() for n, t in params_by_name(model, opt).items()}, norms, shared)
    ref_params, ref_norms = reference_steps(out_cfg(world), STEPS)
    return out, {n: t.numpy() for n, t in ref_params.items()}, ref_norms


def out_cfg(world):
    cfg = make_cfg(world, 0, grad_clip=0.5)
    cfg.model.tie_embeddings = True
    return cfg


def test_tied_model_under_zero_0_1_3_equals_torch_adamw():
    """A tied model with dp=2 under the flat-buffer optimizer (stages 0, 1) and FSDP2 (stage 3):
    one shared Parameter, counted once in the norm, equal to torch AdamW in one process."""
    for rank, (out, ref_params, ref_norms) in enumerate(run_ranks(_tied_against_reference, 2, timeout=300)):
        assert "tok_embeddings.weight" in ref_params and "output.weight" not in ref_params  # one Parameter
        for stage, (params, norms, shared) in out.items():
            assert shared, f"stage {stage}: the head must be the embedding Parameter"
            assert set(params) == set(ref_params), stage
            assert norms == pytest.approx(ref_norms, rel=1e-5), (rank, stage)
            for name, ref in ref_params.items():
                # atol as tests/multirank/test_zero.py's: AdamW divides by sqrt(v), so an element whose
                # gradient nearly cancels turns order-of-sums noise into more (1.2e-6 measured here)
                torch.testing.assert_close(torch.from_numpy(params[name]), torch.from_numpy(ref), rtol=1e-5,
                                           atol=3e-5, msg=f"{rank} stage {stage} {name}")
