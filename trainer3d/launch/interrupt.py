"""The submitting process is told to stop: end the job it started, leave nothing running.

SIGTERM, SIGINT and SIGHUP to ``python -m trainer3d.train`` (a ``kill``, Ctrl-C, a closed
terminal, a CI time limit) must not leave ranks training on their own: they hold the
devices and keep writing the run dir. While a job is followed, ``JobSignals`` turns those
signals into ``Interrupted`` (a BaseException, like KeyboardInterrupt, so no ``except
Exception`` swallows it); the launcher then ends the job (local: ``end_processes``; Slurm:
scancel), prints one line and exits with 128 + the signal number.

A terminal signals more than the submitting process: Ctrl-C sends SIGINT, and a closed
terminal (through its shell) SIGHUP, to the whole foreground process group — submitit's
controller and every rank included. Left to their default actions the ranks would die on the
spot, unsaved, and the controller would kill them (on SIGINT it interrupts its wait and kills
its tasks within a second). So the job is started with SIGINT and SIGHUP blocked
(``terminal_signals_blocked``): the signal mask is inherited across fork and exec
(sigprocmask(2)), so the controller and the ranks never receive them, while the submitting
process unblocks them as soon as the job is submitted and receives them as usual. It then
ends the job as for a ``kill``: SIGTERM to every process, on which the ranks take the agreed
stop at the next step boundary and save (trainer3d/checkpoint/stop.py), one line, and exit
130 (SIGINT) or 129 (SIGHUP). The ranks get ``launcher.signal_delay_s`` for it (the time a
Slurm job gets to checkpoint before its limit: a step of a large model takes longer than a
fixed few seconds); a second signal kills them at once.

Local ranks are found by a token in their environment, not by the process tree
(trainer3d/rank/job_token.py).
"""

import contextlib
import os
import signal
import time
from typing import List, Optional

from trainer3d.rank.job_token import processes_with_token

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
KILL_WAIT_S = 10.0
"""After SIGTERM, ranks get this long to stop (they save a checkpoint at the next step boundary,
trainer3d/checkpoint/stop.py) before SIGKILL — the part Slurm's KillWait plays on a cluster."""


class Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class JobSignals:
    """``with JobSignals() as sig: job = submit(); sig.arm(); follow(job)``.

    Before ``arm()`` a signal is only recorded (so it cannot land between the job's start
    and the moment we know its id); from ``arm()`` on it raises Interrupted. The previous
    handlers come back on exit.
    """

    def __init__(self):
        self.received: Optional[int] = None
        self.again = False
        self.armed = False
        self._previous = {}

    def __enter__(self) -> "JobSignals":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.again = self.received is not None  # a second signal: stop waiting for the ranks to save
        self.received = signum
        if self.armed:
            self.armed = False  # once: ending the job must not be interrupted by a second signal
            raise Interrupted(signum)

    def arm(self) -> None:
        self.armed = True
        if self.received is not None:
            self.armed = False
            raise Interrupted(self.received)

    def __exit__(self, *exc) -> None:
        self.armed = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


TERMINAL_SIGNALS = {signal.SIGINT, signal.SIGHUP}


@contextlib.contextmanager
def terminal_signals_blocked():
    """SIGINT and SIGHUP blocked in this thread meanwhile, and in every process started meanwhile
    for its lifetime (the mask is inherited); one arriving meanwhile is delivered on exit."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _signal_all(pids: List[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_processes(token: str, kill_wait_s: float = KILL_WAIT_S, reap=None, hurry=lambda: False) -> int:
    """SIGTERM (and SIGCONT, for stopped ones) to every process of the job, SIGKILL to those left
    after ``kill_wait_s`` (or as soon as ``hurry()``); returns how many there were. ``reap()``
    collects our own child (the controller) so it does not linger as a zombie."""
    pids = processes_with_token(token)
    _signal_all(pids, signal.SIGTERM)
    _signal_all(pids, signal.SIGCONT)
    deadline = time.monotonic() + kill_wait_s
    while processes_with_token(token) and time.monotonic() < deadline and not hurry():
        if reap:
            reap()
        time.sleep(0.1)
    for _ in range(50):  # SIGKILL cannot be caught; re-sent to anything started meanwhile
        left = processes_with_token(token)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        if reap:
            reap()
        time.sleep(0.1)
    if reap:
        reap()
    return len(pids)
