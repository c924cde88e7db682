"""Class: two runs in one run dir. The run dir's lock is held for the run's lifetime; a second
run is refused before it launches, naming the holder; a dead holder frees it."""

import os
import signal
import subprocess
import sys

import pytest

from tests.support.background import Run
from trainer3d.job.runlock import RunDirBusy, RunDirLock

SMALL = ("parallel=single", "train.max_steps=100000", "train.log_every=1", "train.seq_len=64",
         "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null")


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from trainer3d.job.runlock import RunDirLock; "
                               f"RunDirLock({str(tmp_path)!r}).acquire(job_id='4242'); print('held', flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on host .*, job 4242, started "):
            RunDirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own, the kernel drops the lock
        holder.wait()
    with RunDirLock(str(tmp_path)):
        with pytest.raises(RunDirBusy):  # exclusive within one process too (a second open file)
            RunDirLock(str(tmp_path)).check_free()


@pytest.mark.slow
def test_a_second_run_on_the_same_run_dir_is_refused_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    with Run(run_dir, SMALL) as first:
        first.wait_for("| loss ")
        jobs_before = sorted(p.name for p in (run_dir / "submitit").iterdir())
        second = subprocess.run([sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *SMALL],
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"in use by another run (pid {first.proc.pid} on host" in second.stderr, second.stderr
        assert "job " in second.stderr and "started " in second.stderr
        assert sorted(p.name for p in (run_dir / "submitit").iterdir()) == jobs_before, "nothing was launched"
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 128 + signal.SIGTERM
    assert os.path.exists(run_dir / "run.lock")
