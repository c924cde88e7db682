"""The local launcher with real submitit processes: the ranks meet on the port chosen for them;
failures end the job, with the cause shown. The ranks' bodies live in modules that import only
what they need (tests/support/port_ranks.py, tests/support/failing_ranks.py): a task imports
the module of its function, and this one imports the launcher and pytest."""

import pytest
import submitit

from tests.support.failing_ranks import exit_on_rank_1, hang_on_rank_1, raise_on_rank_1
from tests.support.port_ranks import report_port
from trainer3d.launch.follow import follow
from trainer3d.rank.job_token import new_token
from trainer3d.launch.local import submit_with_token
from trainer3d.rank.master_port import ephemeral_range, local_port


def _submit(tmp_path, fn, tasks=2):
    """As the local launcher submits: the store's port chosen here (trainer3d/rank/master_port.py)."""
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
    executor.update_parameters(tasks_per_node=tasks, timeout_min=5)
    return submit_with_token(executor, fn, new_token(), owned=True)


@pytest.mark.timeout(120)
def test_the_ranks_meet_on_a_free_port_outside_the_ephemeral_range(tmp_path, monkeypatch):
    """submitit draws the port anywhere in 20000-60000, mostly inside the range the kernel gives
    to every connection (gloo's among them): on a busy host rank 0 then found it taken."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    job = _submit(tmp_path, report_port)
    results = job.results()
    ports = {port for _, port in results}
    assert sorted(rank for rank, _ in results) == [0, 1] and len(ports) == 1
    low, high = ephemeral_range()
    (port,) = ports
    assert not low <= port <= high, (port, low, high)


@pytest.mark.timeout(120)
def test_a_master_port_the_user_set_is_kept(tmp_path, monkeypatch):
    """One rank: the port it is given is the claim (ranks meeting on it are the test above's)."""
    chosen = local_port()
    monkeypatch.setenv("MASTER_PORT", str(chosen))
    assert [port for _, port in _submit(tmp_path, report_port, tasks=1).results()] == [chosen]


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
