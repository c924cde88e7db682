"""Stop every rank at the same step boundary when Slurm says the job must end, and save there.

Slurm warns a job before it ends: SIGUSR2 ``launcher.signal_delay_s`` before the time limit
(submitit's ``#SBATCH --signal=USR2@<delay>``) or on ``scancel --signal=USR2``, which asks
for a checkpoint and a requeue; SIGTERM when the job is cancelled or preempted, which asks
for a checkpoint and an exit. The signal need not reach every rank (``scancel --batch``
reaches only the batch shell's step; submitit's own handler acts on rank 0 alone and lets
the others die on a closed connection), and ranks that stop at different steps hang the
ones still inside the next step's collectives. So the handler only records the signal,
and the ranks agree at step boundaries:

- after step s, each rank starts an all-reduce (MAX) of its flag over a CPU gloo group of
  its own, without waiting for it (``async_op``);
- after step s+1, each waits for that result — long done by then — and every rank sees
  the same value, so all stop after the same step s+1, one step after the first signal.

The check costs no synchronisation on the hot path, on CPU or GPU: the flag is a CPU tensor
on a gloo group separate from the training's (NCCL on GPUs), and its round trip overlaps a
whole step (tools/bench/host_overhead.py --profile counts its host time). After the stop the trainer saves a
checkpoint and the rank's ``leave`` (trainer3d/rank/preemption.py) requeues or ends the job.
The agreement lives here, below the loop, because the loop calls it at every step boundary and
its only outcome the loop acts on is a checkpoint at the agreed step.
"""

import contextlib
import signal
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist


# Flags, ordered: a job told to end (TERM) must not requeue because another rank saw USR2.
NONE, REQUEUE, END = 0, 1, 2
FLAG_OF = {signal.SIGUSR2: REQUEUE, signal.SIGTERM: END, signal.SIGINT: END, signal.SIGHUP: END}
"""SIGINT and SIGHUP reach a rank only where it runs in a terminal's process group itself (in
place, under torchrun); the local launcher starts its ranks with them blocked and relays them
as SIGTERM (trainer3d/launch/interrupt.py). Either way they are the same agreed stop."""
NAME_OF = {REQUEUE: "SIGUSR2", END: "SIGTERM"}
TERMINAL = (signal.SIGINT, signal.SIGHUP)
"""A terminal's signals: given back when the loop ends, so a Ctrl-C still interrupts an in-place
run's last save (a Slurm or local job's ranks never see them: FLAG_OF's note)."""
ON_ERROR = (signal.SIGTERM, *TERMINAL)
"""Given back when the loop fails: all but SIGUSR2, whose handler (submitit's) would requeue the
failed job. Until ``close()`` after the last save and the run's summary, a SIGUSR2 is recorded
and left: submitit's handler would requeue a finished job and end rank 0 inside the save while
the others wait in its collectives."""


@dataclass
class Stop:
    step: int
    """Steps completed (the step a resumed run starts at)."""
    flag: int

    @property
    def signal_name(self) -> str:
        return NAME_OF[self.flag]


class StopSignal:
    """Record SIGUSR2/SIGTERM, and agree across ranks on the step boundary to stop at.

    Construct on every rank (it creates a gloo group: a collective); call ``agreed()`` at
    every step boundary, on every rank; ``close()`` at the very end, after the last save,
    settles the last check and restores the handlers it replaced (submitit's).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if group is None and dist.is_initialized():
            group = dist.new_group(backend="gloo")
        self.group = group
        self.local = NONE
        self._pending: Optional[dist.Work] = None
        self._buf = torch.zeros(1, dtype=torch.int32)
        self.previous: Dict[int, object] = {}
        for sig in FLAG_OF:
            try:
                self.previous[sig] = signal.signal(sig, self._record)
            except ValueError:  # not the main thread: nothing can be caught here, nothing to agree on
                pass

    def _record(self, signum, frame) -> None:
        self.local = max(self.local, FLAG_OF[signum])

    def agreed(self) -> int:
        """At a step boundary: the flag every rank agrees on (NONE: go on), one boundary late."""
        seen = NONE
        if self._pending is not None:
            self._pending.wait()
            seen = int(self._buf.item())
            self._pending = None
        if seen == NONE:
            self._buf.fill_(self.local)
            if self.group is None:  # one process, no process group: nothing to agree with
                self._pending = _Done()
            else:
                self._pending = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return seen

    def close(self) -> None:
        if self._pending is not None:  # every rank started the same checks: this one completes
            self._pending.wait()
            self._pending = None
        self.restore(*self.previous)

    def restore(self, *signals: int) -> None:
        """The handlers it replaced for ``signals`` back (the loop's end gives a terminal's
        SIGINT/SIGHUP back before the last save; an error all but SIGUSR2, which would requeue
        a failed job through submitit's handler). A handler set from C reads as None and cannot
        be put back from Python: that signal keeps the recorder."""
        for sig in signals:
            handler = self.previous.get(sig)
            if handler is not None:
                with contextlib.suppress(ValueError):  # not the main thread: nothing was replaced here
                    signal.signal(sig, handler)


class _Done:
    def wait(self) -> bool:
        return True
