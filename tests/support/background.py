"""Run the real entry point in the background and watch what it leaves running.

Every process the run starts inherits a test-chosen mark in its environment
(``T3D_TEST_MARK``), so ``marked(mark)`` finds them all — the submitting process, submitit's
controller, every rank and anything a rank started — independently of how trainer3d
tracks them. ``Run(..., spawn_child=True)`` (``spawning_child`` for another starter) makes
every rank start a detached grandchild (its own session, ``sleep``) through a sitecustomize
module: a child that outlives its rank unless the launcher ends it too.
"""

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.conftest import ROOT

MARK = "T3D_TEST_MARK"
_SITECUSTOMIZE = """
import os, subprocess
if os.environ.get("SUBMITIT_LOCAL_GLOBALID") is not None or os.environ.get("SLURM_PROCID") is not None:
    subprocess.Popen(["sleep", "600"], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def marked(mark: str) -> List[int]:
    """Live (not zombie) processes whose environment carries the mark."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def environ_of(pid: int) -> Dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def spawning_child(env: Dict[str, str], site: Path) -> Dict[str, str]:
    """``env`` with a sitecustomize module first on PYTHONPATH (written into the new folder
    ``site``) through which every rank started with it starts a detached grandchild."""
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])))


class Run:
    """``python -m trainer3d.train`` in its own session, stdout and stderr collected as they come."""

    def __init__(self, run_dir: Path, overrides: Sequence[str], spawn_child: bool = False,
                 env: Optional[dict] = None):
        self.mark = uuid.uuid4().hex
        env = dict(env or os.environ, PYTHONUNBUFFERED="1", **{MARK: self.mark})
        if spawn_child:
            env = spawning_child(env, Path(run_dir).parent / f"site-{self.mark}")
        cmd = [sys.executable, "-m", "trainer3d.train", f"hydra.run.dir={run_dir}", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.out: List[str] = []
        self.err: List[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, into: List[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, text: str, timeout: float = 300, count: int = 1) -> None:
        """Until ``count`` lines of stdout contain ``text`` (e.g. "| loss ": progress lines)."""
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.out) < count:
            assert self.proc.poll() is None, f"the run ended before printing {text!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.text()}"
            time.sleep(0.2)

    def wait(self, timeout: float = 300) -> int:
        """The exit status (leftovers are the caller's to check, then ``kill_leftovers``)."""
        code = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=10)
        return code

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.kill_leftovers()

    def rank_pid(self, rank: int) -> int:
        """The pid of a rank, found by submitit's environment variable in the marked processes."""
        for pid in marked(self.mark):
            env = environ_of(pid)
            if env.get("SUBMITIT_LOCAL_GLOBALID") == str(rank) and "submitit.core._submit" in _cmdline(pid):
                return pid
        raise AssertionError(f"no process of rank {rank}")

    def kill_leftovers(self) -> None:
        """Whatever a failing test leaves must not outlive it."""
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in marked(self.mark):
            try:
                os.kill(pid, 9)
            except OSError:
                pass

    def text(self) -> str:
        return "".join(self.out) + "\n--- stderr ---\n" + "".join(self.err)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
