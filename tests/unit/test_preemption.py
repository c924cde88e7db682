"""trainer3d/rank/preemption.py leave(): after a SIGUSR2 stop rank 0 runs submitit's requeue
handler, whose ``scontrol requeue`` Slurm signals with the rest of the job's processes as it
carries the requeue out (CI's two-node test once failed so: "Command '['scontrol', 'requeue',
'283']' died with <Signals.SIGTERM: 15>" while sacct said REQUEUED)."""

import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trainer3d.checkpoint.stop import REQUEUE, Stop
from trainer3d.rank.preemption import TrainingStopped, leave


def _requeue_signalled_on_the_way(signum, frame):
    """submitit's handler as it runs under Slurm: a program asks for the requeue (here sh, which
    like scontrol installs no SIGTERM handler) and the requeue's SIGTERM reaches it before it
    exits; then submitit exits the process (submitit/core/job_environment.py)."""
    subprocess.check_call(["sh", "-c", "kill -TERM $$; sleep 0.1"], timeout=60)
    sys.exit(-1)


def test_a_requeue_signalled_while_it_is_asked_still_requeues():
    stop_signal = SimpleNamespace(previous={signal.SIGUSR2: _requeue_signalled_on_the_way}, group=None)
    mine = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a handler of the rank's
    try:
        with pytest.raises(SystemExit) as requeued:  # not TrainingStopped(... died with SIGTERM)
            leave(Stop(step=8, flag=REQUEUE), stop_signal, rank=0)
        assert requeued.value.code == -1, "submitit's own exit, which its local executor reads"
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler, "the rank's handler is back"
    finally:
        signal.signal(signal.SIGTERM, mine)


def test_a_refused_requeue_still_fails_the_job():
    def refused(signum, frame):
        subprocess.check_call(["sh", "-c", "exit 1"], timeout=60)

    stop_signal = SimpleNamespace(previous={signal.SIGUSR2: refused}, group=None)
    mine = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with pytest.raises(TrainingStopped, match=r"not requeued: CalledProcessError: .*exit status 1"):
            leave(Stop(step=8, flag=REQUEUE), stop_signal, rank=0)
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler, "the rank's handler is back"
    finally:
        signal.signal(signal.SIGTERM, mine)
