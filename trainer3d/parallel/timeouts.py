"""Two timeouts for the process groups: a generous one for start-up and checkpoint I/O, a
short one for the training step.

A collective that waits past its group's timeout fails (gloo), or NCCL's watchdog aborts
the process. Start-up (rendezvous, building the model, the first step with its compilation
and cold caches) and a checkpoint save or load on a shared filesystem can legitimately take
minutes; a step's collectives cannot, and a dead peer should end the job quickly. So every
group starts with ``parallel.init_timeout_s``; after the first step all of them switch to
``parallel.timeout_s``, except for the first evaluation and the training step after it, which
wait up to the start-up timeout again (``warming_up``): the first evaluation runs the model
without a gradient, so under ``train.compile`` every block compiles again, with tensor
parallelism's collectives between the compiled pieces (a rank still compiling leaves its peers
waiting in them), and with pp > 1 torch's schedule re-infers the stages' shapes, over the
pipeline's sends, on the way into evaluation and back (trainer3d/parallel/pipeline/schedule.py,
``Pipeline.forward``); and the default group — the one DCP saves and loads through and the
checkpoint barriers use — goes back to ``init_timeout_s`` for the length of each save or
load (the same scheme as torchtitan's ``set_pg_timeouts`` in torchtitan/distributed/utils.py,
through torch's ``_set_pg_timeout``).

Groups are never built from another group's backend options object: NCCL keeps a reference
to the options a group was built from, so one object handed to several groups would tie their
timeouts together (torch copies the options in its own ``split_group`` for that reason).
trainer3d/parallel/topology.py lets torch make each group's options and sets the timeout on the group.
"""

import contextlib
import datetime
from typing import Iterator, List

import torch.distributed as dist


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def group_timeout_s(group: dist.ProcessGroup, device) -> float:
    """The timeout ``group``'s backend on ``device`` applies now, in seconds."""
    return group._get_backend(device).options._timeout.total_seconds()


def set_timeout(groups: List[dist.ProcessGroup], timeout_s: float) -> None:
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(seconds(timeout_s), group)


class GroupTimeouts:
    """Switches the run's groups between the start-up/I/O timeout and the step timeout.

    ``groups``: every group the step communicates over (the layout's, including the
    default group). Construct on every rank; the switch is local to each rank, so ranks
    need not switch at the same moment.
    """

    def __init__(self, groups: List[dist.ProcessGroup], init_timeout_s: float, step_timeout_s: float):
        self.groups = list(groups)
        self.init_timeout_s, self.step_timeout_s = init_timeout_s, step_timeout_s
        self.stepping = False

    def to_step(self) -> None:
        """Start-up is over: every group gets the step timeout (idempotent)."""
        if not self.stepping:
            set_timeout(self.groups, self.step_timeout_s)
            self.stepping = True

    @contextlib.contextmanager
    def warming_up(self, warm: bool = True) -> Iterator[None]:
        """Every group waits up to the start-up timeout inside where ``warm`` (a phase that
        compiles or re-infers shapes once: the first evaluation and the step after it); after
        start-up, the step timeout again on the way out."""
        warm = warm and self.stepping
        if warm:
            set_timeout(self.groups, self.init_timeout_s)
        try:
            yield
        finally:
            if warm:
                set_timeout(self.groups, self.step_timeout_s)

    @contextlib.contextmanager
    def io(self) -> Iterator[None]:
        """The default group waits up to the start-up timeout inside (checkpoint saves and loads)."""
        default = dist.distributed_c10d._get_default_group()
        if self.stepping:
            set_timeout([default], self.init_timeout_s)
        try:
            yield
        finally:
            if self.stepping:
                set_timeout([default], self.step_timeout_s)
