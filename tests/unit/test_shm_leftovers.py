"""A rank 0 killed between making its shared-memory segment and unlinking the name leaves the
name in /dev/shm (trainer3d/cpu/shm.py). The next set-up removes exactly such leftovers: this
user's ``trainer3d-<pid>-...`` names whose process is gone and that are older than any set-up,
never a live maker's, a fresh one, or another program's file."""

import os
import subprocess
import sys
import time

from trainer3d.cpu.shm_leftovers import LEFTOVER_AGE_S, sweep_leftovers


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (a reuse within the test is vanishingly unlikely)


def _segment(directory, name: str, age_s: float) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return name


def test_only_a_gone_makers_old_segment_is_removed(tmp_path):
    old = LEFTOVER_AGE_S + 60
    dead = _dead_pid()
    leftover = _segment(tmp_path, f"trainer3d-{dead}-00aa", old)
    keep = [
        _segment(tmp_path, f"trainer3d-{os.getpid()}-00bb", old),  # its maker lives: a set-up may be running
        _segment(tmp_path, f"trainer3d-{dead}-00cc", 5.0),  # fresh: a set-up of another PID namespace
        _segment(tmp_path, "other-program-segment", old),
        _segment(tmp_path, "trainer3d-notapid-00dd", old),
    ]
    assert sweep_leftovers(str(tmp_path)) == [leftover]
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_a_missing_directory_sweeps_nothing(tmp_path):
    assert sweep_leftovers(str(tmp_path / "none")) == []
