"""Class: two runs in one run dir, and a job that outlives its owner. The run dir's lock is held
for the run's lifetime by the submitting process and by every rank of its job; a second run is
refused before it launches, naming the holder, while any of them lives; a job whose submitting
process was killed (SIGKILL: no handler runs) stops at a step boundary, saves and ends."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.background import Run, marked
from tests.support.runs import configure
from trainer3d import train
from trainer3d.checkpoint import store
from trainer3d.rank.resume import COMMAND_VAR
from trainer3d.rank.runlock import RunDirBusy, RunDirLock

SMALL = ("parallel=single", "train.max_steps=100000", "train.log_every=1", "train.seq_len=64",
         "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null")


def _holding(directory) -> int:
    """A process forked from this one (no interpreter to start, no torch to import) that takes
    the lock of ``directory`` as job 4242 and keeps it until it is killed: its pid, once it holds it."""
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready)
            RunDirLock(str(directory)).acquire(job_id="4242")
            os.write(told, b"held")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(told)
    try:
        assert os.read(ready, 4) == b"held"
    finally:
        os.close(ready)
    return pid


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = _holding(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=rf"pid {holder} on host .*, job 4242, started "):
            RunDirLock(str(tmp_path)).acquire()
    finally:
        os.kill(holder, signal.SIGKILL)  # no clean-up of its own, the kernel drops the lock
        os.waitpid(holder, 0)
    with RunDirLock(str(tmp_path)):
        with pytest.raises(RunDirBusy):  # exclusive within one process too (a second open file)
            RunDirLock(str(tmp_path)).check_free()


def test_a_rank_holding_the_run_dir_keeps_it_busy_after_its_submitter_died(tmp_path):
    """What a local rank does (runlock.join), in a process whose submitter record names a dead pid."""
    lock = RunDirLock(str(tmp_path)).acquire()
    lock.record("77", token="no-such-token")
    lock.share()
    rank = subprocess.Popen([sys.executable, "-c", "import time; from trainer3d.rank.runlock import join; "
                             f"join({str(tmp_path)!r}); print('joined', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "joined"
        lock.release()  # the submitting process is gone; its rank is not
        with pytest.raises(RunDirBusy, match=r"pid \d+ on host .*, job 77, started .*"):
            RunDirLock(str(tmp_path)).check_free()
    finally:
        rank.kill()
        rank.wait()
    RunDirLock(str(tmp_path)).check_free()


@pytest.mark.slow
def test_a_second_run_is_refused_while_the_first_lives_and_its_job_never_outlives_its_submitter(tmp_path):
    """One running job, two checks in turn. A second start on its run dir (another seed: its
    record would differ) is refused before it launches or writes anything, naming the holder: the
    running run's recorded config (.hydra/) and lock record are what they were, as its submitit
    folder (every check comes before any write). Then kill -9 of the first run's submitting
    process (no handler runs): its ranks hold the run dir until they are gone, then stop at a step
    boundary, save and exit on their own; nothing is left running."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "checkpoint.every=1000000", "parallel.timeout_s=60"]
    with Run(run_dir, overrides) as run:
        run.wait_for("| loss ", count=2)
        jobs_before = sorted(p.name for p in (run_dir / "submitit").iterdir())
        records = _records(run_dir)
        assert ".hydra/config.yaml" in records and "run.lock" in records, sorted(records)
        second = subprocess.run([sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides,
                                 "train.seed=7"], capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"run dir {run_dir} is in use by another run (pid {run.proc.pid} on host" in second.stderr, \
            second.stderr
        assert "job " in second.stderr and "started " in second.stderr
        assert sorted(p.name for p in (run_dir / "submitit").iterdir()) == jobs_before, "nothing was launched"
        assert _records(run_dir) == records, "the refused start wrote into the running run's records"
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
        with pytest.raises(RunDirBusy, match=rf"pid {run.proc.pid} on host .*, which has exited; its processes "
                                             r"still running: pid \d+"):
            RunDirLock(str(run_dir)).check_free()
        deadline = time.monotonic() + 120
        while marked(run.mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marked(run.mark) == [], "the job outlived its submitting process"
    saved = store.published(run_dir / "checkpoints")
    assert len(saved) == 1 and store.is_complete(saved[0][1]) == (True, ""), saved
    assert os.path.exists(run_dir / "run.lock")
    RunDirLock(str(run_dir)).check_free()


def _records(run_dir):
    """The running run's files that only a start writes: its recorded config (.hydra/) and its
    lock record (the rest, its logs and metrics, grow while it runs)."""
    files = [run_dir / "run.lock", *sorted((run_dir / ".hydra").rglob("*"))]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file()}


def test_the_lock_covers_a_checkpoint_dir_outside_the_run_dir(tmp_path, capsys, monkeypatch):
    """Two runs with their own run dirs and one checkpoint.dir: the second is refused, naming it.
    The entry point's ``run`` in this process, on the config Hydra composes for that command line."""
    monkeypatch.setenv(COMMAND_VAR, "")  # run() records the resume command here; restored after
    shared = tmp_path / "shared"
    cfg = configure(tmp_path / "b", [*SMALL, "train.max_steps=1", f"checkpoint.dir={shared}"])
    with RunDirLock(str(shared)):  # held by a run whose checkpoint.dir it is
        assert train.run(cfg) == 2
    err = capsys.readouterr().err
    assert f"checkpoint dir {shared} (checkpoint.dir) is in use by another run" in err, err
