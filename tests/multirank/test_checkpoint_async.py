"""Saves in the background: training goes on while a save is written; a preemption stop, the
next save and the end of the run wait for it; a stop while a save is in flight loses no step;
a signal during the run's last save neither stops nor requeues the finished run.

The ranks run the trainer in-process (tests/support/harness.py). Each background write is
slowed down from outside (the saver's ``write`` wrapped in the rank), so the runs below
really have a save in flight when the loop reaches the next step, the next save or the stop.
"""

import json
import os
import signal
import time
from pathlib import Path

import torch.distributed as dist

from tests.support.harness import dims_for, run_ranks
from trainer3d.checkpoint import saver, store
from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.trainer import Trainer

WRITE_DELAY_S = 1.5


def _cfg(run_dir: str, world: int, max_steps: int, resume: str = "never") -> Config:
    cfg = Config(run_dir=run_dir)
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.parallel.timeout_s = world, 1, 60
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 4, None
    cfg.train.seq_len, cfg.train.resume, cfg.model.n_layers = 32, resume, 1
    cfg.train.max_steps, cfg.train.log_every, cfg.logger.mode = max_steps, 1, "disabled"
    cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.save_final = 4, 10, True
    return validate(cfg)


def _slow_writes(log: list) -> None:
    """Every background write starts WRITE_DELAY_S late; ``log`` gets (step, start, end) of each."""
    real = saver.write

    def slow(job, group, rank):
        started = time.monotonic()
        time.sleep(WRITE_DELAY_S)
        try:
            return real(job, group, rank)
        finally:
            log.append((job.step, started, time.monotonic()))
    saver.write = slow


def _preempted_then_resumed(rank: int, world: int, root: str) -> dict:
    writes: list = []
    _slow_writes(writes)
    steps_seen = []
    trainer = Trainer(_cfg(f"{root}/run", world, 12), dims_for(dp=world))
    real_step = trainer.train_step

    def step(s):
        steps_seen.append((s, time.monotonic()))
        if s == 5 and rank == 1:  # the step-4 save is in flight: Slurm's warning reaches one rank only
            os.kill(os.getpid(), signal.SIGUSR2)
        return real_step(s)
    trainer.train_step = step
    trainer.train()
    stopped = trainer.stopped.step
    resumed = Trainer(_cfg(f"{root}/run", world, 12, resume="auto"), dims_for(dp=world))
    start = resumed.start_step
    resumed.train()
    Trainer(_cfg(f"{root}/whole", world, 12), dims_for(dp=world)).train()
    return {"stopped": stopped, "start": start, "writes": writes, "steps": steps_seen}


def test_a_stop_waits_for_the_save_in_flight_and_loses_no_step(tmp_path):
    results = run_ranks(_preempted_then_resumed, 2, str(tmp_path), timeout=600)
    stopped = results[0]["stopped"]
    assert [r["stopped"] for r in results] == [stopped] * 2 and stopped in (6, 7), results
    assert [r["start"] for r in results] == [stopped] * 2  # the stop's own checkpoint, written after the one in flight
    writes, steps = results[0]["writes"], dict(results[0]["steps"])
    step4 = next(w for w in writes if w[0] == 4)
    assert steps[5] < step4[2], "training went on while the step-4 save was written"
    ckpts = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in store.published(ckpts)] == [4, stopped, 8, 12]
    assert all(store.is_complete(p)[0] for _, p in store.published(ckpts)) and not list(ckpts.glob("*.partial"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    whole = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole], "the preempted run lost or changed a step"
    saved = [r for r in whole if "ckpt_stall_s" in r]  # the row after each save in the loop
    assert [r["step"] for r in saved] == [4, 8] and saved[0]["ckpt_stall_s"] < WRITE_DELAY_S
    assert all(r["ckpt_write_s"] >= WRITE_DELAY_S for r in whole if "ckpt_write_s" in r)
    assert len([r for r in whole if "ckpt_write_s" in r]) >= 1


def _damaged_newest_is_skipped(rank: int, world: int, root: str) -> dict:
    Trainer(_cfg(f"{root}/run", world, 8), dims_for(dp=world)).train()
    if rank == 0:  # a flipped byte in the newest checkpoint's data, after it was published
        data = next(store.step_dir(Path(root) / "run" / "checkpoints", 8).glob("*.distcp"))
        blob = bytearray(data.read_bytes())
        blob[len(blob) // 2] ^= 1
        data.write_bytes(bytes(blob))
    dist.barrier()
    resumed = Trainer(_cfg(f"{root}/run", world, 8, resume="auto"), dims_for(dp=world))
    return {"start": resumed.start_step, "bad": [str(p) for p in resumed.checkpointer.known_bad]}


def test_the_ranks_verify_the_data_they_load_and_auto_falls_back(tmp_path):
    """Rank 0 checks only marker, metadata and sizes; the data is hashed by the ranks that read
    it (each file once): a damaged newest checkpoint is found there and ``auto`` takes the older one."""
    results = run_ranks(_damaged_newest_is_skipped, 2, str(tmp_path), timeout=300)
    bad = str(store.step_dir(tmp_path / "run" / "checkpoints", 8))
    assert results == [{"start": 4, "bad": [bad]}] * 2


def _signalled_in_the_last_save(rank: int, world: int, root: str) -> dict:
    """A SIGUSR2 reaches rank 0 as the run's last save starts (Slurm's warning after the last
    step); a recorder stands in for submitit's handler, which requeues the job and exits."""
    seen: list = []
    interrupt = signal.getsignal(signal.SIGINT)

    def submitits(signum, frame):
        seen.append(signum)
    previous = signal.signal(signal.SIGUSR2, submitits)
    try:
        trainer = Trainer(_cfg(f"{root}/run", world, 3), dims_for(dp=world))
        real_save = trainer.save_checkpoint

        def save(step, background=None):
            # a terminal's Ctrl-C interrupts the last save as it would any code (an in-place run)
            seen.append(signal.getsignal(signal.SIGINT) is interrupt)
            if rank == 0:
                os.kill(os.getpid(), signal.SIGUSR2)
            return real_save(step, background)
        trainer.save_checkpoint = save
        trainer.train()
        back = signal.getsignal(signal.SIGUSR2) is submitits
    finally:
        signal.signal(signal.SIGUSR2, previous)
    return {"seen": seen, "stopped": trainer.stopped, "back": back}


def test_a_signal_in_the_last_save_neither_requeues_nor_stops_the_finished_run(tmp_path):
    """The run's stop handlers hold until its last save is written: the signal is the trainer's
    to record and leave (nothing is left to stop), never submitit's requeue of a finished job,
    which would end rank 0 inside the save while the others wait in its collectives."""
    results = run_ranks(_signalled_in_the_last_save, 2, str(tmp_path), timeout=300)
    assert results == [{"seen": [True], "stopped": None, "back": True}] * 2, results
    ckpts = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in store.published(ckpts)] == [3]
