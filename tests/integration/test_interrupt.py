"""Class: the submitting process is told to stop (trainer3d/launch/interrupt.py), its parts
without a job: the job's processes found by their token, a signal held until the job is known, a
second signal. The entry point's own runs: SIGTERM to the submitting process alone ends the whole
local job and names the checkpoint and the resume command (tests/integration/test_stop_resume.py);
SIGINT and SIGHUP from a terminal, to its whole foreground group (tests/integration/test_terminal.py)."""

import signal
import time

import pytest

from trainer3d.launch.interrupt import JobSignals, end_processes
from trainer3d.rank.job_token import new_token, processes_with_token


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
