"""Rank bodies for the local launcher's port test (tests/integration/test_launch.py): the ranks
meet through torch.distributed's env:// rendezvous on the port the launcher chose for them.

A submitit task imports the module its function lives in as it unpickles it; this one imports
what the meeting needs (torch.distributed, and the engine's own ``export_rank_env``, which
every rank of the entry point runs first), not the test module's launcher, follower and pytest.
"""

import datetime
import os

import torch.distributed as dist

from trainer3d.rank.task import export_rank_env


def report_port():
    """(rank, MASTER_PORT) once every rank has joined the group on it and passed a barrier."""
    export_rank_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rank, port = dist.get_rank(), int(os.environ["MASTER_PORT"])
    dist.barrier()
    return rank, port
