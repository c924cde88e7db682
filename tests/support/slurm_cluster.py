"""The dev Slurm cluster of slurm/cluster.sh (two namespace nodes, or one), for the tests marked ``slurm``.

Started once per test session (a few seconds once the packages are installed; the first
start installs them) and stopped as soon as the last test that uses it is done (``stop_after``,
called from tests/conftest.py), not at the session's end: on two workers the tier is one unit of
work, taken early (its two-node tests are slow), and its ~10 s of daemons exiting then overlap
the other tests instead of ending the whole run. Before anything is installed or created, one
line on the terminal says what the start will do to this machine (``cluster.sh announce``):
as root it apt-installs Slurm, munge and MariaDB and makes a bridge and network namespaces. Where it cannot run here (not root, no
apt-get: cluster.sh exits 3) the tests skip with that reason — except under CI (``CI`` set),
where they fail: CI must run them for real.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "cluster.sh"


def announce(config, line: str) -> None:
    """``line`` on the terminal as the tier starts, past pytest's capture (a worker's stderr is
    the terminal's: pytest-xdist's workers inherit it)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        sys.stderr.write(f"\n{line}\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory, request):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # one worker owns the cluster: a second would start and stop it under the first's jobs
        owner = tmp_path_factory.getbasetemp().parent / "slurm-owner"
        try:
            with open(owner, "x") as f:
                f.write(worker)
        except FileExistsError:
            pytest.fail(f"the Slurm tests run on {owner.read_text()} and {worker}: they must share one worker "
                        "(tests/conftest.py: xdist_scope)")
    state = Path(os.environ.get("TRAINER3D_SLURM_DIR", "/tmp/trainer3d-slurm"))
    said = subprocess.run(["bash", str(SCRIPT), "announce"], capture_output=True, text=True, timeout=60)
    announce(request.config, said.stdout.strip() or said.stderr.strip())
    if said.returncode == 3 and not os.environ.get("CI"):
        pytest.skip(said.stdout.strip())
    proc = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3 and not os.environ.get("CI"):
        pytest.skip(f"no Slurm cluster here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"slurm/cluster.sh start failed:\n{proc.stderr[-4000:]}"
    env = dict(os.environ, SLURM_CONF=str(state / "etc" / "slurm.conf"))
    # Every node of the dev cluster is this machine: a rank alone on its node would size its
    # threads from all the machine's cores (trainer3d/rank/threads.py) beside the other node's
    # ranks and stall at each OpenMP region. One thread each, as under two xdist workers
    # (tests/conftest.py); sbatch passes the submitting environment on to the ranks.
    env.setdefault("OMP_NUM_THREADS", "1")
    _running.append(env)
    yield env
    _stop()


_running: list = []
"""The environment of the cluster this process started and has not stopped yet (at most one)."""


def _stop() -> None:
    while _running:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=300, env=_running.pop())


def stop_after(item) -> None:
    """Stop the cluster once ``item``, just torn down, is the session's last test that uses it, in
    the order they run: the order of collection, under ``-n 0`` as on a worker, which takes the
    tier as one unit of work (tests/conftest.py: xdist_scope). The session fixture's own teardown
    then has nothing left to stop."""
    if _running and "slurm_cluster" in item.fixturenames:
        last = [i for i in item.session.items if "slurm_cluster" in getattr(i, "fixturenames", ())][-1]
        if item is last:
            _stop()
