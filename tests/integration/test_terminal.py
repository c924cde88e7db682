"""Class: interrupts from a terminal save. On a real pseudo-terminal, Ctrl-C (SIGINT to the
whole foreground process group, from the line discipline) and a hang-up (SIGHUP to the whole
group, as the shell relays it) do not kill the ranks on the spot: the controller and the ranks
never receive them, the submitting process ends the job, on which the ranks take the agreed stop
at a step boundary and save a checkpoint, and the run exits with one line (130 after Ctrl-C,
the signal this test's run ends on), leaving
nothing running: each rank starts a grandchild in a session of its own, out of the terminal's
reach, which the launcher ends too (SIGTERM to the submitting process alone: test_interrupt.py)."""

import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
import time
import uuid

import pytest

from tests.conftest import ROOT
from tests.support.background import MARK, marked, spawning_child
from trainer3d.checkpoint import store

SMALL = ("parallel=dp2", "train.max_steps=100000", "train.log_every=1", "train.seq_len=64",
         "train.micro_batch_size=2", "train.global_batch_size=16", "train.grad_accum_steps=null",
         "parallel.timeout_s=60", "checkpoint.every=1000000")


class Terminal:
    """``python -m trainer3d.train`` as the session leader of a new pseudo-terminal, in its
    foreground process group, as a shell starts a command."""

    def __init__(self, run_dir, overrides):
        self.mark = uuid.uuid4().hex
        self.master, slave = os.openpty()
        env = spawning_child(dict(os.environ, PYTHONUNBUFFERED="1", **{MARK: self.mark}),
                             run_dir.parent / f"site-{self.mark}")

        def controlling_terminal():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}",
                                      *overrides], stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env,
                                     preexec_fn=controlling_terminal)
        os.close(slave)
        self.output = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: every process closed the terminal
                return
            if not data:
                return
            self.output += data

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def wait_for(self, text: str, count: int, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while self.text().count(text) < count:
            assert self.proc.poll() is None, f"ended before {count} x {text!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {count} x {text!r} within {timeout} s:\n{self.text()}"
            time.sleep(0.2)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.close(self.master)
        except OSError:
            pass


def _in_the_foreground_group(term, pids):
    """Those of ``pids`` a terminal's signal reaches (the submitting process's group: submitit's
    controller and the ranks, not the grandchildren in sessions of their own)."""
    reached = []
    for pid in pids:
        try:
            if os.getpgid(pid) == term.proc.pid:
                reached.append(pid)
        except OSError:
            continue
    return reached


@pytest.mark.slow
def test_a_terminal_interrupt_stops_every_rank_at_a_step_boundary_with_a_checkpoint(tmp_path):
    """One run, both terminal signals. SIGHUP and SIGINT take one path in the submitting process
    (trainer3d/launch/interrupt.py: JobSignals, with SIGTERM; its SIGHUP is
    tests/integration/test_interrupt.py's test_a_signal_before_arm_is_held_until_the_job_is_known)
    and differ where the terminal's whole group gets them: each must be blocked in the controller and
    the ranks (``TERMINAL_SIGNALS``). So SIGHUP first goes to every process of the group but the
    submitting one (a terminal's hang-up as the ranks get it): nothing stops, training goes on;
    then Ctrl-C to the whole group stops every rank at a step boundary with a checkpoint."""
    run_dir = tmp_path / "run"
    term = Terminal(run_dir, SMALL)
    try:
        term.wait_for("| loss ", count=2)
        started = marked(term.mark)
        assert len(started) >= 6, "submitting process + controller + 2 ranks + their grandchildren"
        group = [pid for pid in _in_the_foreground_group(term, started) if pid != term.proc.pid]
        assert len(group) >= 3, f"controller + 2 ranks in the terminal's group: {group} of {started}"
        for pid in group:
            os.kill(pid, signal.SIGHUP)
        logged = term.text().count("| loss ")
        term.wait_for("| loss ", count=logged + 2)  # two more steps: the hang-up stopped nothing
        ended = set(group) - set(marked(term.mark))
        assert not ended, f"SIGHUP ended {ended} of {group}:\n{term.text()}"
        os.write(term.master, b"\x03")  # Ctrl-C: the line discipline signals the foreground group
        code = term.proc.wait(timeout=120)
        time.sleep(0.5)
        left = marked(term.mark)
        assert code == 128 + signal.SIGINT, term.text()
        assert left == [], f"still running: {left} of {started}\n{term.text()}"
        said = [line for line in term.text().splitlines() if "SIGINT: ending job" in line]
        assert len(said) == 1, term.text()
        assert "Traceback" not in term.text(), term.text()
        saved = store.published(run_dir / "checkpoints")
        assert len(saved) == 1 and saved[0][0] >= logged + 2, f"{saved}\n{term.text()}"
        assert store.is_complete(saved[0][1]) == (True, ""), saved
    finally:
        term.close()
