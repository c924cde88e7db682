"""The compiled host AdamW kernel of ZeRO-Offload (host_adamw.cpp beside this file).

Bit for bit torch's fused CPU AdamW (``torch._fused_adamw_``, the test holds it so:
tests/unit/test_offload_adamw.py), faster where it runs: one call and one split over the
cores for every run of the owned state, and two vectors in flight per loop turn
(docs/offload.md, "The host step", has the figures). Built on first use with the machine's
C++ compiler through the package's one build path (trainer3d/cpu/build.py:
``torch.utils.cpp_extension.load``, as DeepSpeed builds its CPU Adam); the vector width is
chosen at run time, so one build serves any x86-64 CPU of a cluster that shares the cache. Where it cannot be built (no compiler, not
x86-64) the engine runs torch's kernel instead, with a one-line notice.
"""

import platform
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Tuple

import torch

from trainer3d.cpu.build import Build

SOURCE = Path(__file__).with_name("host_adamw.cpp")
NAME = "trainer3d_host_adamw"
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
"""No -march: the AVX-512 and AVX2 paths carry their own target attributes. No contraction of
a multiply and an add into an FMA the source does not spell out: the bits must be torch's.
-fopenmp: at::parallel_for is an OpenMP region compiled into the extension
(ATen/ParallelOpenMP.h), serial without it (tests/unit/test_offload_adamw.py counts its threads)."""


def _vector_module(module: ModuleType) -> ModuleType:
    if module.isa() == "scalar":
        raise RuntimeError("the CPU has neither AVX-512 nor AVX2 with FMA")
    return module


def _not_x86() -> Optional[str]:
    machine = platform.machine()
    return None if machine.lower() in ("x86_64", "amd64") else f"the CPU is {machine}, the kernel is written for x86-64"


BUILD = Build(NAME, SOURCE, FLAGS, "host AdamW", "running torch's fused CPU kernel (same results, slower)",
              _vector_module, python_module=True, unfit=_not_x86)


def host_kernel() -> Optional[ModuleType]:
    """The compiled kernel, built once per process (and cached across processes); None where it
    cannot be built, after one logged line saying why and that torch's kernel runs instead."""
    return BUILD.get()


def run_table(runs: List[Tuple[int, int, bool]]) -> torch.Tensor:
    """The kernel's ``runs`` argument: int64 [k, 3] rows of (start, end, decays)."""
    return torch.tensor([[lo, hi, int(d)] for lo, hi, d in runs], dtype=torch.int64).reshape(-1, 3)
