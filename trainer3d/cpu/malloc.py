"""Keep freed host memory in the process on CPU ranks, so that each step's activations do not
page-fault in afresh.

glibc's malloc serves an allocation of more than its mmap threshold (128 KiB at first, rising
to at most 32 MiB as such blocks are freed) with a fresh mmap and gives it back at free, and
trims the top of its heap whenever more than twice that is free there. A CPU step allocates
and frees tensors of hundreds of KiB to tens of MiB hundreds of times, so each one arrives as
zeroed pages through a page fault per 4 KiB (docs/performance.md has what that costs a step of
the DeepSpeed pair's model, tools/bench/deepspeed_pair.py). Raising both thresholds makes freed
blocks reusable; the process holds its heap between steps, which every step reaches again. The
heap settles above the step's peak (freed blocks split by small allocations must coalesce before
a large one fits them again): four 40 MiB tensors a step settled at 0.5-0.7 GiB of heap after 3
to 5 steps (tests/unit/test_cpu_malloc.py's pattern).
This is the glibc side of what CPU-training launchers do with jemalloc or tcmalloc
(torch.backends.xeon.run_cpu ``--enable-jemalloc``/``--enable-tcmalloc``).

Left alone where the user chose: any ``MALLOC_*`` or ``GLIBC_TUNABLES`` setting, or an
allocator preloaded in ``LD_PRELOAD``; a no-op where the C library is not glibc.
"""

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = (256 << 20, 32 << 20)
"""Blocks up to this many bytes come from the heap: the first value glibc accepts (versions
before 2.26 refuse more than 32 MiB on 64-bit hosts)."""
TRIM_THRESHOLD = 1 << 30


def user_chose() -> bool:
    """Whether the environment already says how malloc behaves."""
    return (any(k.startswith("MALLOC_") for k in os.environ) or "GLIBC_TUNABLES" in os.environ
            or "malloc" in os.environ.get("LD_PRELOAD", ""))


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; True where they were raised."""
    if user_chose():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not any(mallopt(M_MMAP_THRESHOLD, value) == 1 for value in MMAP_THRESHOLD):
        return False
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
