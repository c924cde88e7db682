"""What the ranks do after the agreed stop (trainer3d/checkpoint/stop.py) and its checkpoint:
requeue the job through submitit's handler on SIGUSR2, or exit on SIGTERM, every rank alike.
"""

import signal
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from trainer3d.checkpoint.stop import END, Stop, StopSignal
from trainer3d.checkpoint.store import checkpoint_root, step_dir
from trainer3d.rank.resume import command_for

NOT_SUBMITIT = "not a submitit job: nothing requeues it"
EXITED, REQUEUED, REFUSED = 0, 1, 2  # what leave() does after the stop
REQUEUE_ASKED = "asking Slurm to requeue the job"
"""The end of rank 0's stop line before the requeue (a refusal follows it in one more line)."""
EXIT_STOPPED = 75
"""Exit status of ranks stopped for good (sysexits' EX_TEMPFAIL: resubmit to resume)."""


class TrainingStopped(RuntimeError):
    """The ranks stopped on a signal and the job could not be requeued."""


def leave(stop: Stop, stop_signal: StopSignal, rank: int, cfg=None) -> None:
    """End every rank after an agreed stop and a saved checkpoint. Never returns.

    SIGUSR2 in a submitit job: rank 0 calls submitit's handler, which calls
    ``TrainTask.checkpoint`` (a DelayedSubmission of the same task, or None past
    launcher.max_requeues), dumps it and runs ``scontrol requeue``; then every rank exits
    without writing a result (SystemExit), so the next attempt's results are the only ones.
    A refused requeue raises TrainingStopped on every rank: the job fails with the reason.
    SIGTERM, or no submitit: every rank exits with EXIT_STOPPED.
    """
    submitit_exit: Optional[SystemExit] = None
    outcome, reason = EXITED, NOT_SUBMITIT
    saved = "checkpoint saved"
    if cfg is not None:  # the run's Config: name the checkpoint and the command that resumes it
        saved = f"checkpoint {step_dir(checkpoint_root(cfg), stop.step)} saved"
    what = f"stopped after step {stop.step} on {stop.signal_name}; {saved}"
    if stop.flag == END:
        reason = "SIGTERM: the job was cancelled or preempted"
    elif rank == 0:
        handler = stop_signal.previous.get(signal.SIGUSR2)
        if callable(handler):
            # Said before the requeue, which cancels the job's steps: a rank slow to get here
            # again (a loaded node) may be killed after Slurm's KillWait with the line unsaid.
            print(f"trainer3d: {what}; {REQUEUE_ASKED}", flush=True)
            outcome, reason = REFUSED, "submitit's handler returned without requeuing"
            try:
                with _children_ignore_sigterm():
                    handler(signal.SIGUSR2, None)
            except SystemExit as requeued:  # submitit exits after `scontrol requeue`
                outcome, submitit_exit = REQUEUED, requeued
            except Exception as err:  # noqa: BLE001 - e.g. UncompletedJobError past max_requeues
                reason = f"{type(err).__name__}: {err}"
    outcome = _broadcast(outcome, stop_signal.group)
    if outcome == REQUEUED:
        if submitit_exit is not None:
            raise submitit_exit  # its exit status is how submitit's local executor sees a requeue
        sys.exit(0)
    if outcome == REFUSED:
        raise TrainingStopped(f"{what}; not requeued: {reason if rank == 0 else 'see rank 0'}")
    if rank == 0:
        command = command_for(cfg) if cfg is not None else ""
        print(f"trainer3d: {what}; not requeued ({reason}): "
              + (f"resume with: {command}" if command else "resubmit or requeue to resume"), file=sys.stderr, flush=True)
    sys.exit(EXIT_STOPPED)


_UNCHANGED = object()


@contextmanager
def _children_ignore_sigterm() -> Iterator[None]:
    """Ignore SIGTERM while submitit's handler runs ``scontrol requeue``, which inherits it ignored.

    Slurm carries out a requeue by signalling every process of the job's steps, the ``scontrol``
    that asked for it among them: SIGTERM can reach it before it has read slurmctld's answer, and
    submitit then takes the accepted requeue for a refused one (CalledProcessError, "died with
    SIGTERM"), so the job would fail while Slurm requeues it. An ignored signal stays ignored
    across exec (a blocked one does not: shells unblock it), and scontrol sets no SIGTERM handler
    of its own (Slurm 22.05's ``scontrol requeue`` under strace: SIGALRM and SIGPIPE only). This
    rank loses nothing: it has stopped and saved, and leaves right after; Slurm's SIGKILL follows
    its KillWait either way.
    """
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: no disposition can change here
        previous = _UNCHANGED
    try:
        yield
    finally:
        if previous is not _UNCHANGED:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _broadcast(value: int, group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return value
    buf = torch.tensor([value], dtype=torch.int32)
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    return int(buf.item())
