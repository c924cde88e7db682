"""The compiled host AdamW kernel of ZeRO-Offload (host_adamw.cpp beside this file).

Bit for bit torch's fused CPU AdamW (``torch._fused_adamw_``, the test holds it so:
tests/unit/test_offload_adamw.py), faster where it runs: one call and one split over the
cores for every run of the owned state, and two vectors in flight per loop turn
(docs/offload.md, "The host step", has the figures). Built on first use with the machine's
C++ compiler through the package's one build path (trainer3d/cpu/build.py:
``torch.utils.cpp_extension.load``, as DeepSpeed builds its CPU Adam) into a plain shared
library with a C interface and no torch headers, loaded with ``ctypes`` as the model's CPU
kernels are (trainer3d/cpu/kernels.py); the vector width is
chosen at run time, so one build serves any x86-64 CPU of a cluster that shares the cache. Where it cannot be built (no compiler, not
x86-64) the engine runs torch's kernel instead, with a one-line notice.
"""

import ctypes
import platform
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from trainer3d.cpu.build import Build, c_library

SOURCE = Path(__file__).with_name("host_adamw.cpp")
NAME = "trainer3d_host_adamw"
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"]
"""No -march: the AVX-512 and AVX2 paths carry their own target attributes. No contraction of
a multiply and an add into an FMA the source does not spell out: the bits must be torch's.
-fopenmp: the split over the cores is an OpenMP region, serial without it
(tests/unit/test_offload_adamw.py counts its threads)."""
ABI = 1
ISAS = ("scalar", "avx2", "avx512")
"""The vector paths by the number ``t3d_host_adamw_isa`` returns."""

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "t3d_host_adamw_isa": ([], ctypes.c_int),
    "t3d_host_adamw_parallel_threads": ([ctypes.c_int], _I),
    "t3d_host_adamw_step": ([_P, _P, _P, _P, _I, _P, _I, _D, _D, _D, _D, _D, _D, _P, _P, ctypes.c_int, ctypes.c_int],
                            ctypes.c_int),
}


def _threads() -> int:
    """The threads a step splits over: torch's intra-op count (``torch.set_num_threads``), which
    the library's OpenMP runtime does not see by itself."""
    return torch.get_num_threads()


class HostAdamWKernel:
    """The built library: AdamW on runs of flat fp32 host buffers, bit for bit torch's fused CPU
    kernel; what the library cannot see (devices, dtypes, lengths) is checked here."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def isa(self) -> str:
        """The widest vector path this CPU runs."""
        return ISAS[self._lib.t3d_host_adamw_isa()]

    def parallel_threads(self) -> int:
        """Threads one split of the kernel runs on (torch's intra-op count)."""
        return self._lib.t3d_host_adamw_parallel_threads(_threads())

    def adamw_step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   runs: torch.Tensor, step: torch.Tensor, lr: float, beta1: float, beta2: float,
                   weight_decay: float, eps: float, grad_scale: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor], isa: int) -> None:
        """AdamW on ``runs`` (``run_table``) of the state, in place. ``step``: the counter torch's
        kernel reads (already advanced); ``grad_scale`` divides the gradients (stored back);
        ``found_inf`` 1 skips the step; ``isa``: -1 the best this CPU has, else 0 scalar,
        1 AVX2, 2 AVX-512."""
        n = param.numel()
        for t in (param, grad, exp_avg, exp_avg_sq):
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("host AdamW: the state must be contiguous fp32 host tensors")
            if t.numel() != n:
                raise ValueError("host AdamW: the state tensors differ in length")
        if runs.dtype != torch.int64 or runs.dim() != 2 or runs.size(1) != 3 or not runs.is_contiguous():
            raise ValueError("host AdamW: runs must be a contiguous int64 [k, 3] tensor")
        scalars = []
        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32 or t.numel() != 1):
                raise ValueError(f"host AdamW: {name} must be one fp32 host value")
            scalars.append(None if t is None else t.data_ptr())
        if self._lib.t3d_host_adamw_step(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                                         exp_avg_sq.data_ptr(), n, runs.data_ptr(), runs.size(0), step.item(), lr,
                                         beta1, beta2, weight_decay, eps, *scalars, isa, _threads()):
            raise ValueError("host AdamW: a run lies outside the state")


def _vector_kernel(path: str) -> HostAdamWKernel:
    kernel = HostAdamWKernel(c_library("t3d_host_adamw_abi", ABI, _SIGNATURES)(path))
    if kernel.isa() == "scalar":
        raise RuntimeError("the CPU has neither AVX-512 nor AVX2 with FMA")
    return kernel


def _not_x86() -> Optional[str]:
    machine = platform.machine()
    return None if machine.lower() in ("x86_64", "amd64") else f"the CPU is {machine}, the kernel is written for x86-64"


BUILD = Build(NAME, SOURCE, FLAGS, "host AdamW", "running torch's fused CPU kernel (same results, slower)",
              _vector_kernel, unfit=_not_x86)


def host_kernel() -> Optional[HostAdamWKernel]:
    """The compiled kernel, built once per process (and cached across processes); None where it
    cannot be built, after one logged line saying why and that torch's kernel runs instead."""
    return BUILD.get()


def run_table(runs: List[Tuple[int, int, bool]]) -> torch.Tensor:
    """The kernel's ``runs`` argument: int64 [k, 3] rows of (start, end, decays)."""
    return torch.tensor([[lo, hi, int(d)] for lo, hi, d in runs], dtype=torch.int64).reshape(-1, 3)
