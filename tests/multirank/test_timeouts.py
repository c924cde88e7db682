"""Process-group timeouts: start-up and checkpoint I/O wait long, the step's collectives do not
(trainer3d/parallel/timeouts.py), on real gloo groups."""

import time

import torch
import torch.distributed as dist

from tests.support.harness import dims_for, run_ranks
from trainer3d.config.schema import Config
from trainer3d.parallel.timeouts import GroupTimeouts, group_timeout_s, set_timeout
from trainer3d.parallel.topology import ParallelDims, Topology
from trainer3d.trainer import Trainer
from trainer3d.config.validate import validate

CPU = torch.device("cpu")
NAMES = ("default", "tp", "dp", "pp", "embedding", "embedding_dp")


def _timeouts_of(dims: ParallelDims) -> dict:
    return {name: group_timeout_s(group, CPU) for name, group in zip(NAMES, dims.groups())}


def _switches(rank, world):
    dims = ParallelDims.build(Topology(tp=2, pp=2, dp=2), CPU, tied_embeddings=True, timeout_s=300)
    seen = {"built": _timeouts_of(dims)}
    set_timeout([dims.tp_group], 40)  # one group alone: no other may follow it (shared options would)
    seen["tp_alone"] = _timeouts_of(dims)
    timeouts = GroupTimeouts(dims.groups(), init_timeout_s=300, step_timeout_s=7)
    timeouts.to_step()
    seen["step"] = _timeouts_of(dims)
    with timeouts.io():
        seen["io"] = _timeouts_of(dims)
    seen["after_io"] = _timeouts_of(dims)
    return seen


def test_every_group_has_its_own_timeout_switched_between_startup_io_and_step():
    for seen in run_ranks(_switches, 8, timeout=180, pg_timeout_s=300):
        assert seen["built"] == {name: 300 for name in NAMES}
        assert seen["tp_alone"] == {**seen["built"], "tp": 40}
        assert seen["step"] == {name: 7 for name in NAMES}
        assert seen["io"] == {**seen["step"], "default": 300}
        assert seen["after_io"] == seen["step"]


# The save outlasts the step timeout three times over; nothing but sleeps and two collectives
# that must fail runs under the 1-s timeout, so load cannot trip it early.
STEP_S, SLOW_SAVE_S = 1.0, 3.0


def _slow_save_then_stuck_step(rank, world):
    # tp=2 so that the dp groups ([0, 2], [1, 3]) are not the default group (a mesh
    # dimension spanning the world may be the default group itself)
    dims = ParallelDims.build(Topology(tp=2, pp=1, dp=2), CPU, timeout_s=120)
    timeouts = GroupTimeouts(dims.groups(), init_timeout_s=120, step_timeout_s=STEP_S)
    timeouts.to_step()
    with timeouts.io():  # a save whose writes take longer than the step timeout on one rank
        if rank == 1:
            time.sleep(SLOW_SAVE_S)
        dist.barrier()
    outcome = {"save": "ok"}
    if rank != 0:  # never join the step's collectives, but stay alive (hung peers, not dead ones)
        time.sleep(3 * STEP_S + 4)
        return outcome
    for name, group in (("dp", dims.dp_group), ("default", None)):
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            outcome[name] = "completed"
        except RuntimeError as err:
            outcome[name] = ("failed", time.monotonic() - started, str(err).splitlines()[0])
    return outcome


def test_slow_checkpoint_io_passes_while_a_stuck_step_collective_fails_within_timeout_s():
    # The harness's bound (90 s) is below init_timeout_s (120 s): were the step collectives
    # still on the start-up timeout, the run would be killed and the test fail.
    rank0, *others = run_ranks(_slow_save_then_stuck_step, 4, timeout=90, pg_timeout_s=120)
    assert [r["save"] for r in (rank0, *others)] == ["ok"] * 4
    for name in ("dp", "default"):
        status, waited, message = rank0[name]
        assert status == "failed", (name, rank0[name])
        assert waited >= STEP_S * 0.9, (name, waited)  # it waited for the peer, then gave up
        assert "timed out" in message.lower() or "timeout" in message.lower(), message


def _trainer_group_timeouts(rank, world, run_dir):
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.timeout_s, cfg.parallel.init_timeout_s = world, 17, 300
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 4, None
    cfg.train.seq_len, cfg.train.resume, cfg.model.n_layers = 32, "never", 1
    trainer = Trainer(validate(cfg), dims_for(dp=world))
    trainer.timeouts.to_step()
    return {"stop_signal": group_timeout_s(trainer.stop_signal.group, CPU),
            "layout": sorted({group_timeout_s(g, CPU) for g in trainer.dims.groups()})}


def test_the_trainers_groups_take_the_step_timeout_the_stop_signals_too(tmp_path):
    """After start-up every group the trainer waits on has parallel.timeout_s, the stop signal's
    agreement (waited for at each step boundary) included: not torch's 30-minute default."""
    for seen in run_ranks(_trainer_group_timeouts, 2, str(tmp_path), timeout=120):
        assert seen == {"stop_signal": 17, "layout": [17]}



EVAL_STEP_S, SLOW_EVAL_S = 4.0, 10.0


def _slow_first_evaluation(rank, world, run_dir):
    """tp=2, so the evaluation's forward has collectives between the ranks; rank 1 takes longer
    than the step timeout before its first evaluation's forward, as a rank still compiling the
    blocks without a gradient does (train.compile) while its peer waits in a tp all-reduce."""
    cfg = Config(run_dir=run_dir)
    cfg.parallel.tp, cfg.parallel.timeout_s, cfg.parallel.init_timeout_s = world, EVAL_STEP_S, 120
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 2, None
    cfg.train.seq_len, cfg.train.resume, cfg.train.max_steps, cfg.model.n_layers = 32, "never", 4, 1
    cfg.train.eval_every, cfg.train.eval_steps, cfg.data.val_fraction = 2, 1, 0.01
    cfg.checkpoint.every, cfg.checkpoint.save_final = 0, False
    trainer = Trainer(validate(cfg), dims_for(tp=world))
    seen = {"steps": [], "evals": []}

    def timeout_now():
        return sorted({group_timeout_s(g, CPU) for g in trainer.dims.groups()})

    train_step, forward_only = trainer.train_step, trainer.forward_only

    def timed_step(step):
        seen["steps"].append(timeout_now())
        return train_step(step)

    def timed_forward(inputs, targets):
        if not seen["evals"] and rank == 1:
            time.sleep(SLOW_EVAL_S)
        seen["evals"].append(timeout_now())
        return forward_only(inputs, targets)

    trainer.train_step, trainer.forward_only = timed_step, timed_forward
    trainer.train()
    return seen


def test_the_first_evaluation_and_the_step_after_it_keep_the_startup_timeout(tmp_path):
    """A rank 10 s late into the first evaluation (step timeout 4 s) does not end the run: the
    first evaluation and the training step after it wait up to parallel.init_timeout_s; the
    other steps and the second evaluation have parallel.timeout_s."""
    for seen in run_ranks(_slow_first_evaluation, 2, str(tmp_path), timeout=240):
        # the first step has the groups' build-time timeout (the harness's); start-up ends after it
        assert seen["steps"][1:] == [[EVAL_STEP_S], [120], [EVAL_STEP_S]]
        assert seen["evals"] == [[120], [EVAL_STEP_S]]
