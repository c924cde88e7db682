"""job/host_malloc.py: a CPU rank keeps freed host memory, so a step's tensors do not arrive as
fresh page faults; left alone where the user set malloc's behaviour. Each case runs in its own
process (the setting is process-wide)."""

import os
import subprocess
import sys

import pytest

from trainer3d.job import host_malloc

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

CODE = """
import resource, sys, torch
from trainer3d.job.host_malloc import keep_freed_memory
raised = keep_freed_memory() if sys.argv[1] == "1" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's pattern: activations of 1 MiB each, all alive at once, then freed
    held = [torch.ones(2 ** 18) for _ in range(16)]
    del held
for _ in range(3):
    step()
before = faults()
for _ in range(10):
    step()
print(raised, (faults() - before) / 10)
"""


def _faults_per_round(keep: bool, **env) -> tuple:
    proc = subprocess.run([sys.executable, "-c", CODE, "1" if keep else "0"], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert proc.returncode == 0, proc.stderr
    raised, faults = proc.stdout.split()
    return raised == "True", float(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_memory_is_reused_without_page_faults():
    """Sixteen 1 MiB tensors alive at once, then freed, ten times: by default glibc gives the
    freed top of its heap back to the system and every round faults its 4,096 pages in again;
    with the thresholds raised, no page faults."""
    clean = {k: None for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}
    raised, kept = _faults_per_round(True, **clean)
    _, default = _faults_per_round(False, **clean)
    assert raised
    assert default > 2000 and kept < 100, (default, kept)


def test_the_users_choice_stands(monkeypatch):
    for var, value in (("MALLOC_ARENA_MAX", "2"), ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1"),
                       ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")):
        monkeypatch.setenv(var, value)
        assert host_malloc.user_chose() and not host_malloc.keep_freed_memory()
        monkeypatch.delenv(var)
