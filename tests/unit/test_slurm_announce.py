"""``slurm/cluster.sh announce``: the one line the Slurm tier prints before it installs or
creates anything, on a machine where Slurm's programs are missing (a PATH without them)."""

import os
import shutil
import subprocess

from tests.conftest import ROOT

SCRIPT = ROOT / "slurm" / "cluster.sh"
# what the script runs before it reaches the announcement (cluster.sh, slurm/nodes.sh)
CORE = ("bash", "id", "tr", "hostname", "date", "dirname", "cat", "grep", "sed", "seq")


def _announce(tmp_path, extra=()):
    """The script run with a PATH of only CORE and ``extra`` (cluster.sh appends /usr/sbin and
    /sbin, where Debian keeps the daemons but not sbatch or sacct: those stay missing)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in (*CORE, *extra):
        if not (bin_dir / name).exists():
            os.symlink(shutil.which(name), bin_dir / name)
    state = tmp_path / "state"
    proc = subprocess.run([str(bin_dir / "bash"), str(SCRIPT), "announce"], capture_output=True, text=True,
                          timeout=60, env={"PATH": str(bin_dir), "TRAINER3D_SLURM_DIR": str(state)})
    assert not state.exists(), "announce created the state directory"
    return proc


def test_without_slurm_or_apt_get_the_tier_says_it_skips(tmp_path):
    proc = _announce(tmp_path)
    assert proc.returncode == 3, proc.stderr
    line, = proc.stdout.splitlines()
    assert line.startswith("Slurm tier: skipped, Slurm is not installed (missing: ") and "sbatch" in line


def test_as_root_with_apt_get_it_names_the_packages_the_bridge_and_the_namespaces(tmp_path):
    if os.geteuid() != 0:
        proc = _announce(tmp_path, ["apt-get"])
        assert proc.returncode == 3 and "not root" in proc.stdout
        return
    proc = _announce(tmp_path, ["apt-get"])
    assert proc.returncode == 0, proc.stderr
    line, = proc.stdout.splitlines()
    for said in ("apt-get installs slurmctld slurmd slurm-client munge slurmdbd slurm-wlm-mysql-plugin "
                 "mariadb-server", "a bridge (t3d-br0)", "network namespaces", str(tmp_path / "state")):
        assert said in line, (said, line)
