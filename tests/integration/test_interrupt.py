"""Class: the submitting process is told to stop. SIGTERM to ``python -m trainer3d.train`` ends
the whole local job — every rank and every process a rank started, even one in a session of its
own — prints one line and exits 128 + the signal. SIGINT and SIGHUP take the same path
(trainer3d/launch/interrupt.py: JobSignals); they come from a terminal, to its whole foreground
group, and tests/integration/test_terminal.py sends them so, with the same checks."""

import signal
import time

import pytest

from tests.support.background import Run, marked
from trainer3d.launch.interrupt import JobSignals, end_processes
from trainer3d.rank.job_token import new_token, processes_with_token

# One rank: the launcher ends the job's processes by their mark (trainer3d/rank/job_token.py), one
# rank or many alike; the ranks' agreed stop at a step boundary is tests/integration/test_terminal.py's.
SMALL = ("parallel=single", "train.max_steps=100000", "train.log_every=1", "train.seq_len=64",
         "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null",
         "parallel.timeout_s=60")


@pytest.mark.slow
def test_a_signal_to_the_submitting_process_ends_every_rank_and_child(tmp_path):
    sig = signal.SIGTERM
    with Run(tmp_path / "run", SMALL, spawn_child=True) as run:
        run.wait_for("| loss ")
        started = marked(run.mark)
        assert len(started) >= 4, "submitting process + controller + a rank + its grandchild"
        sent = time.monotonic()
        run.proc.send_signal(sig)
        code = run.wait(timeout=120)
        left = marked(run.mark)
        print(f"{sig.name}: {len(started)} processes, none left {time.monotonic() - sent:.1f} s after the signal")
        assert code == 128 + sig, run.text()
        assert left == [], f"still running after the submitting process exited: {left}\n{run.text()}"
        said = [line for line in run.err if f"{sig.name}: ending job" in line]
        assert len(said) == 1, run.text()


def test_end_processes_finds_children_by_token_not_by_tree(tmp_path):
    """A process started with the token, detached into its own session, is still found and ended."""
    import os
    import subprocess

    token = new_token()
    env = dict(os.environ, TRAINER3D_JOB=token)
    child = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600 & wait"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30  # the shell forks its background sleep when it gets the CPU
        while len(processes_with_token(token)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with_token(token)) == 3  # the shell and its two sleeps
        assert end_processes(token, kill_wait_s=5, reap=child.poll) == 3
        assert processes_with_token(token) == []
    finally:
        child.kill()
        child.wait()


def test_a_signal_before_arm_is_held_until_the_job_is_known():
    with JobSignals() as signals:
        signal.raise_signal(signal.SIGHUP)  # lands "during submission": recorded only
        assert signals.received == signal.SIGHUP
        with pytest.raises(BaseException) as raised:
            signals.arm()
        assert type(raised.value).__name__ == "Interrupted" and raised.value.signum == signal.SIGHUP


def test_a_second_signal_asks_to_kill_at_once():
    with JobSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        assert not signals.again
        signal.raise_signal(signal.SIGINT)  # Ctrl-C twice: stop waiting for the ranks to save
        assert signals.again
