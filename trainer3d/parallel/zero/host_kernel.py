"""The compiled host AdamW kernel of ZeRO-Offload (host_adamw.cpp beside this file).

Bit for bit torch's fused CPU AdamW (``torch._fused_adamw_``, the test holds it so:
tests/unit/test_offload_adamw.py), faster where it runs: one call and one split over the
cores for every run of the owned state, and two vectors in flight per loop turn
(docs/offload.md, "The host step", has the figures). Built on first use with the machine's
C++ compiler by ``torch.utils.cpp_extension.load`` (as DeepSpeed builds its CPU Adam) and
cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); the vector width is chosen at run time, so one build serves
any x86-64 CPU of a cluster that shares the cache. Where it cannot be built (no compiler, not
x86-64) the engine runs torch's kernel instead, with a one-line notice.
"""

import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Tuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_adamw.cpp")
NAME = "trainer3d_host_adamw"
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
"""No -march: the AVX-512 and AVX2 paths carry their own target attributes. No contraction of
a multiply and an add into an FMA the source does not spell out: the bits must be torch's.
-fopenmp: at::parallel_for is an OpenMP region compiled into the extension
(ATen/ParallelOpenMP.h), serial without it (tests/unit/test_offload_adamw.py counts its threads)."""

_loaded: Optional[ModuleType] = None
_tried = False


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    # ninja (a dependency) installs its binary beside this interpreter, which a venv used
    # without activating has off PATH; torch's build looks for it on PATH.
    path = os.environ.get("PATH", "")
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and scripts:
        os.environ["PATH"] = scripts + os.pathsep + path
    try:
        return cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    finally:
        os.environ["PATH"] = path


def host_kernel() -> Optional[ModuleType]:
    """The compiled kernel, built once per process (and cached across processes); None where it
    cannot be built, after one logged line saying why and that torch's kernel runs instead."""
    global _loaded, _tried
    if not _tried:
        _tried = True
        if platform.machine().lower() not in ("x86_64", "amd64"):
            reason = f"the CPU is {platform.machine()}, the kernel is written for x86-64"
        elif shutil.which(os.environ.get("CXX", "c++")) is None:
            reason = "no C++ compiler (c++ or $CXX) on PATH"
        else:
            try:
                _loaded = _build()
                reason = "" if _loaded.isa() != "scalar" else "the CPU has neither AVX-512 nor AVX2 with FMA"
            except Exception as e:  # any build failure leaves torch's kernel in place
                reason = f"its build failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            if reason:
                _loaded = None
        if _loaded is None:
            log.warning("host AdamW: %s; running torch's fused CPU kernel (same results, slower)", reason)
    return _loaded


def run_table(runs: List[Tuple[int, int, bool]]) -> torch.Tensor:
    """The kernel's ``runs`` argument: int64 [k, 3] rows of (start, end, decays)."""
    return torch.tensor([[lo, hi, int(d)] for lo, hi, d in runs], dtype=torch.int64).reshape(-1, 3)
