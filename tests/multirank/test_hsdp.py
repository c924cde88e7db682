"""Hybrid sharding (HSDP, ``parallel.dp_shard``): FSDP2 on a 2-D (replicate, shard) mesh trains
the single-process model (fp32, relative 1e-5 over 20 steps), each rank holds the shard of its
place in its shard group, the same as its replicas, and its checkpoints load into other layouts
and theirs into it.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from tests.support.harness import run_ranks
from tests.support.zero_ranks import make_cfg, params_by_name, reference_steps, train_step
from trainer3d.memory.states import engine_model_state_bytes
from trainer3d.model.transformer import Transformer
from trainer3d.observe.telemetry import model_state_bytes
from trainer3d.parallel.parallelize import build_model_chunks, build_optimizer
from trainer3d.parallel.topology import ParallelDims, Topology
from trainer3d.parallel.zero.flat import bucket_numel
from tests.integration.test_checkpoint_resume import assert_close
from tests.support.runs import (PARITY, TWO_LAYERS, assert_parity, read_metrics, reference_dir, reference_losses,
                                train_in_ranks, train_losses)
from trainer3d.checkpoint import store

# One layout trains 20 steps against the one-process run: ZeRO-3 HSDP over tensor-parallel slices
# with sequence parallelism (a fault of HSDP's mesh, of FSDP2 over tp slices or of sp moves its
# losses), and its checkpoint of step 12 starts the chain of resharded resumptions (last test).
# ZeRO-2 HSDP trains in the chain's last link (steps 16-19 against the same reference) and, with
# ZeRO-3, three steps against torch's AdamW in test_hsdp_shards_over_the_group_and_trains_as_one_process.
HSDP_TP = ("parallel.zero_stage=3", "parallel.tp=2", "parallel.dp=4", "parallel.dp_shard=2",
           "parallel.sequence_parallel=true")
TRAINED = (*PARITY, *TWO_LAYERS)
CHAIN_START = 12
"""The step of the HSDP run's one checkpoint, where the chain starts: past the warm-up, moments of
12 steps in it (the chain's links then train 3, 3 and 4 steps)."""


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory, session_tmp):
    """The 20 steps of HSDP_TP, a checkpoint at step CHAIN_START (its run directory)."""
    run = tmp_path_factory.mktemp("hsdp")
    train_in_ranks(run, [*TRAINED, "parallel=single", *HSDP_TP, f"checkpoint.every={CHAIN_START}"])
    return run


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 4-8 gloo ranks on 2 loaded cores
def test_hsdp_matches_single_process(hsdp_run, session_tmp):
    assert_parity(train_losses(hsdp_run), reference_losses(session_tmp, TRAINED))
    # the replicas' shards are counted once in the global norm: a double count is sqrt(2) apart,
    # the order of sums ~1e-5 (1.2e-5 measured at step 7 of dp4 S=2), so 1e-4 tells them apart
    norms = [r["grad_norm"] for r in read_metrics(hsdp_run)]
    ref_norms = [r["grad_norm"] for r in read_metrics(reference_dir(session_tmp, TRAINED))]
    assert norms == pytest.approx(ref_norms, rel=1e-4)


def _hsdp_rank(rank, world, shard):
    """ZeRO-2 then ZeRO-3: three steps of the engine's HSDP on the tiny model each, what the rank
    holds and the final parameters."""
    return {stage: _hsdp_stage(world, shard, stage) for stage in (2, 3)}


def _hsdp_stage(world, shard, stage, dtype="fp32"):
    cfg = make_cfg(world, stage, dtype=dtype, grad_clip=0.5)
    cfg.parallel.dp_shard = shard
    dims = ParallelDims.build(Topology(tp=1, pp=1, dp=world, dp_shard=shard), torch.device("cpu"))
    chunks = build_model_chunks(cfg, dims)
    model, opt = chunks[0], build_optimizer(chunks, cfg, dims)
    norms = [train_step(model, opt, cfg, dims.dp_rank, step).item() for step in range(3)]
    local = [p.to_local().detach().clone() for p in model.parameters()]
    placements = {tuple(p.placements) for p in model.parameters()}
    # the replicas' copies of this rank's shard (the same place in the other replicas)
    replicas = [torch.empty_like(torch.cat([t.flatten() for t in local])) for _ in range(world // shard)]
    dist.all_gather(replicas, torch.cat([t.flatten() for t in local]), group=dims.hsdp_mesh.get_group(0))
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Transformer(cfg.model).parameters()]
    want = engine_model_state_bytes(shapes, shard, stage, dtype, bucket_numel(cfg), dims.zero_shard_rank)
    params = {n: t.numpy() for n, t in params_by_name(model, opt).items()}  # plain arrays cross the queue
    views = {v.name: (v.start, v.end) for v in opt.checkpoint_views()}  # what a checkpoint reads and writes
    return dict(norms=norms, params=params, placements=placements, mesh=dims.hsdp_mesh.shape, views=views,
                shard_numel=sum(t.numel() for t in local), replicas_equal=all(torch.equal(r, replicas[0]) for r in replicas),
                measured=model_state_bytes([model], opt), want=want.total - want.gathered, shapes=shapes)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 4-8 gloo ranks on 2 loaded cores
def test_hsdp_shards_over_the_group_and_trains_as_one_process():
    """dp=4, dp_shard=2 (4 gloo ranks, the tiny model, 3 steps): parameters are Shard(0) over the
    shard group and Replicate over the replicas on a 2-D mesh; each rank holds its half of the
    rows of every parameter (a hand count; full sharding would hold a quarter), the same
    as its replica; the model-state bytes it holds are trainer3d/memory/states.py's with N = 2,
    exactly; its checkpoint pieces are those rows; parameters and gradient norms match torch's
    AdamW on one process (the tolerances of tests/multirank/test_zero.py's stage 2/3 comparison)."""
    world, shard = 4, 2
    by_stage = run_ranks(_hsdp_rank, world, shard, timeout=600)
    ref_params, ref_norms = reference_steps(make_cfg(world, 0, grad_clip=0.5), 3)
    assert ref_norms[0] > 0.5, "the clip must be active for the norm to matter"
    for rank, stage in ((rank, stage) for rank in range(world) for stage in (2, 3)):
        r = by_stage[rank][stage]
        # rank = replica * 2 + k holds rows [k * ceil(rows / 2), ...) of each parameter (torch.chunk)
        k = rank % shard
        held = sum(min(-(-s[0] // shard), max(0, s[0] - k * -(-s[0] // shard))) * math.prod(s[1:])
                   for s in r["shapes"])
        assert r["mesh"] == (world // shard, shard)
        assert r["placements"] == {(Replicate(), Shard(0))}
        assert r["shard_numel"] == held and r["replicas_equal"], (rank, stage)
        assert r["measured"] == r["want"], (rank, stage, r["measured"], r["want"])
        for name, value in ref_params.items():  # the checkpoint's pieces: the same rows, flat
            per, row = -(-value.shape[0] // shard), math.prod(value.shape[1:])
            lo, hi = min(k * per, value.shape[0]) * row, min((k + 1) * per, value.shape[0]) * row
            assert r["views"][name] == (lo, hi), (rank, stage, name)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), (rank, stage)
        for name, value in ref_params.items():
            # atol as tests/multirank/test_zero.py's (AdamW's sqrt(v) and order-of-sums noise)
            torch.testing.assert_close(torch.from_numpy(r["params"][name]), value, rtol=1e-5, atol=3e-5,
                                       msg=f"{rank} {stage} {name}")
    # 16 bytes per parameter of the shard group's share (the ZeRO paper's 16Ψ/N, fp32, N = dp_shard),
    # plus the step counter; ZeRO-2 keeps its gathered parameters only from forward to backward
    psi = sum(math.prod(s) for s in by_stage[0][3]["shapes"])
    assert by_stage[0][3]["measured"] == pytest.approx(16 * psi / shard, rel=0.02)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three runs of up to 4 gloo ranks on 2 loaded cores
def test_hsdp_checkpoints_reshard_to_zero1_and_one_process_and_back(hsdp_run, tmp_path, session_tmp):
    """HSDP (tp2 x dp4, S=2, ZeRO-3, sp: the run above) -> ZeRO-1 dp2 -> one process -> HSDP (dp4,
    S=2, ZeRO-2), each link resuming from the previous one's checkpoint (the pattern of
    tests/integration/test_checkpoint_resume.py's reshard chain: each link saves at the step the
    next resumes from and stops one step after it), steps 12-19 trained once along the chain, each
    link's losses within 1e-5 of the uninterrupted 1-rank run's: every link's first loss reads the
    parameters it loaded, and its second and third the updates it made with the moments it loaded."""
    ref = reference_losses(session_tmp, TRAINED)
    chain = [(("parallel.dp=2", "parallel.zero_stage=1"), CHAIN_START), (("parallel.zero_stage=0",), CHAIN_START + 2),
             (("parallel.dp=4", "parallel.dp_shard=2", "parallel.zero_stage=2"), CHAIN_START + 4)]
    same_schedule = f"optim.decay_steps={20 - 5}"  # PARITY: 20 steps, 5 of warm-up
    previous = hsdp_run
    for i, (lay, start) in enumerate(chain):
        run = tmp_path / f"run{i + 1}"
        save, stop = (chain[i + 1][1], chain[i + 1][1] + 1) if i + 1 < len(chain) else (0, 20)  # 0: no save
        stdout = train_in_ranks(run, [*TRAINED, "parallel=single", *lay, f"checkpoint.every={save}", same_schedule,
                                      f"train.max_steps={stop}",
                                      f"train.resume={store.step_dir(previous / 'checkpoints', start)}"])
        assert "layout changed since the checkpoint" in stdout
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == list(range(start, stop))
        assert_close([r["loss"] for r in rows], ref[start:stop])
        previous = run
