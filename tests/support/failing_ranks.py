"""Rank bodies for the local launcher's failure reports (tests/integration/test_launch.py): a
rank that raises, dies without a word, or hangs, beside a peer that waits for it and gives up.

The follower under test reads only what the job's processes leave (result pickles, exits,
logs), so these bodies import neither torch nor trainer3d (whose package imports torch): each
process of the job costs an interpreter's start, not torch's import (seconds of CPU a rank).
The peer's wait stands for a collective bounded by ``parallel.timeout_s``; the trainer's real
collectives giving up on a stuck stage are tests/integration/test_pp_failure.py's, a real rank
killed mid-save tests/integration/test_checkpoint_resume.py's.
"""

import os
import time

import submitit

WAIT_S = 3.0
"""How long the surviving rank waits for its peer before it raises, as a collective's timeout would:
long enough that rank 1's fault (at once after its start) comes first on a loaded machine, where the
two tasks, started together by submitit's controller, each import no more than submitit."""


def _rank() -> int:
    return submitit.JobEnvironment().global_rank


def _peer_never_answers(rank: int) -> None:
    time.sleep(WAIT_S)
    raise TimeoutError(f"rank {rank}: no word from rank 1 in {WAIT_S:.0f} s (as a collective's timeout)")


def raise_on_rank_1():
    rank = _rank()
    if rank == 1:
        raise ValueError("boom on rank 1")
    _peer_never_answers(rank)  # rank 0 waits for a peer that is gone


def exit_on_rank_1():
    rank = _rank()
    if rank == 1:
        os._exit(3)  # dies without a word (OOM killer, segfault)
    _peer_never_answers(rank)


def hang_on_rank_1():
    rank = _rank()
    if rank == 1:
        time.sleep(3600)  # alive but stuck
    _peer_never_answers(rank)
