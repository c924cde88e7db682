"""The local launcher with real submitit processes: failures end the job, with the cause shown."""

import datetime
import os
import time

import pytest
import submitit
import torch.distributed as dist

from trainer3d.job.follow import follow


def _init():
    submitit.helpers.TorchDistributedEnvironment().export(overwrite=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    return dist.get_rank()


def raise_on_rank_1():
    rank = _init()
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(0.5)
    dist.barrier()  # rank 0 waits for a peer that is gone


def exit_on_rank_1():
    rank = _init()
    if rank == 1:
        os._exit(3)  # dies without a word (OOM killer, segfault)
    dist.barrier()


def hang_on_rank_1():
    rank = _init()
    if rank == 1:
        time.sleep(3600)  # alive but stuck
    dist.barrier()


def _submit(tmp_path, fn, tasks=2):
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
    executor.update_parameters(tasks_per_node=tasks, timeout_min=5)
    return executor.submit(fn)


@pytest.mark.timeout(300)  # a job left hanging would wait out gloo's 30-minute default instead
@pytest.mark.parametrize("fn,shown", [
    (raise_on_rank_1, ["rank 1: ValueError: boom on rank 1", "--- rank 1 traceback", "raise_on_rank_1"]),
    (exit_on_rank_1, ["rank 1: exited without a result", "--- rank 1 log tail"]),
    (hang_on_rank_1, ["rank 1: still running after the others failed; cancelled", "--- rank 0 traceback"]),
])
def test_a_failing_rank_ends_the_job_with_its_cause(tmp_path, capfd, fn, shown):
    job = _submit(tmp_path, fn)
    status = follow(job, timeout_s=5)
    err = capfd.readouterr().err
    assert status == 1
    for fragment in shown:
        assert fragment in err, err
    assert job.done()
