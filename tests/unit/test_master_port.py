"""trainer3d/rank/master_port.py: the store's port avoids the ephemeral range and ports in use."""

import os
import socket

import pytest
import submitit

from trainer3d.rank.task import export_rank_env
from trainer3d.rank.master_port import DEFAULT_EPHEMERAL, LOWEST, ephemeral_range, is_free, job_port, local_port


class Scripted:
    """An rng whose draws are the given ports, in order (``choice`` picks the range holding it)."""

    def __init__(self, ports):
        self.ports = list(ports)
        self.index = None

    def choice(self, ranges):
        port = self.ports.pop(0)
        span = next(r for r in ranges if port in r)
        self.index = span.index(port)
        return span

    def randrange(self, n):
        return self.index


def test_a_port_something_listens_on_is_skipped():
    taken = local_port(ephemeral=DEFAULT_EPHEMERAL)
    free = taken + 1 if taken + 1 < DEFAULT_EPHEMERAL[0] else taken - 1
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        assert not is_free(taken)
        assert local_port(Scripted([taken, free]), ephemeral=DEFAULT_EPHEMERAL) == free
    assert is_free(taken)


def test_the_port_is_outside_this_hosts_ephemeral_range():
    low, high = ephemeral_range()
    for _ in range(20):
        port = local_port()
        assert not low <= port <= high and port >= LOWEST and is_free(port)


def test_where_every_port_is_ephemeral_the_kernel_chooses():
    port = local_port(ephemeral=(1024, 65535))
    assert 1024 <= port <= 65535 and is_free(port)


def test_the_ephemeral_range_is_read_or_defaults(tmp_path):
    path = tmp_path / "range"
    path.write_text("10000\t50000\n")
    assert ephemeral_range(str(path)) == (10000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == DEFAULT_EPHEMERAL
    path.write_text("garbage")
    assert ephemeral_range(str(path)) == DEFAULT_EPHEMERAL


def test_a_jobs_port_is_the_same_everywhere_and_below_the_ephemeral_range():
    ports = [job_port(str(1000 + i)) for i in range(2000)]
    assert ports == [job_port(str(1000 + i)) for i in range(2000)]
    assert all(LOWEST <= p < DEFAULT_EPHEMERAL[0] for p in ports)
    assert len(set(ports)) > 1800  # spread: two jobs on one node rarely share a port
    assert job_port("4321_7") != job_port("4321_8")  # array tasks differ


SLURM_TASK = dict(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4321", SLURM_PROCID="0", SLURM_LOCALID="0",
                  SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="node7",
                  SLURM_STEP_ID="0")


@pytest.fixture
def slurm_task(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")) or key in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in SLURM_TASK.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # export() overwrites them; monkeypatch restores them after
        monkeypatch.delenv(key)
    return monkeypatch


def test_a_slurm_task_derives_its_port_from_the_job_id(slurm_task):
    assert submitit.JobEnvironment().job_id == "4321"
    export_rank_env()
    assert os.environ["MASTER_PORT"] == str(job_port("4321"))
    assert os.environ["MASTER_ADDR"] == "node7" and os.environ["WORLD_SIZE"] == "2"


def test_a_slurm_task_keeps_the_users_port(slurm_task):
    slurm_task.setenv("MASTER_PORT", "23456")
    export_rank_env()
    assert os.environ["MASTER_PORT"] == "23456"
