"""Fused CPU kernels for RMSNorm, the rotary embedding and SwiGLU (kernels.cpp beside this file).

trainer3d/cpu/ops.py registers them as the CPU implementation of the model's operators
(model/functional.py) for plain contiguous fp32 tensors, where the operator composition pays
a pass over memory and a dispatch per operator (docs/performance.md has the figures); any
other input runs the composition. The model's Functions save the same tensors either way, so
saved-activation accounting does not depend on which runs.

Built on first use with the machine's C++ compiler into a plain shared library (no torch
headers: a second or two) and loaded with ``ctypes`` (trainer3d/cpu/build.py); where it cannot
be built (no compiler, a failed build) one logged line and the composition runs.
``TRAINER3D_CPU_KERNELS=0`` turns the kernels off (``enabled(False)`` inside a process).
"""

import contextlib
import ctypes
import os
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from trainer3d.cpu.build import Build, c_library

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math"]
"""-ffp-contract=off: no fused multiply-add the source does not spell out, so every clone (AVX-512,
AVX2, baseline) rounds alike; -fno-math-errno and -fno-trapping-math (no errno, no floating-point
traps: results unchanged) let the loops with exp and selects vectorise; -fopenmp: the row loops split over ``torch.get_num_threads()``
threads, in the OpenMP runtime torch itself loaded (its wheel's libgomp.so.1)."""
ABI = 2

_lib: Optional[ctypes.CDLL] = None
_on = os.environ.get("TRAINER3D_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {
    "t3d_rms_norm_forward": ([_P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int], None),
    "t3d_rms_norm_backward": ([_P, _P, _P, _P, _P, _P, _P, _I, _I, ctypes.c_int], None),
    "t3d_rotary": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int], None),
    "t3d_swiglu_forward": ([_P, _P, _P, _I, ctypes.c_int], None),
    "t3d_swiglu_backward": ([_P, _P, _P, _P, _P, _P, _I, ctypes.c_int], None),
}
NORM_BLOCK = 64
"""Rows per partial sum of RMSNorm's weight gradient (kNormBlock in kernels.cpp)."""


LIBRARY = Build("trainer3d_cpu_kernels", SOURCE, FLAGS, "model CPU kernels",
                "running torch's operators (same model, slower on CPU)", c_library("t3d_kernels_abi", ABI, _SIGNATURES))


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, built once per machine; None where they cannot be, after one
    logged line saying why."""
    global _lib
    _lib = LIBRARY.get()
    return _lib


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Use the kernels (True) or the composition (False) inside the block."""
    global _on
    before, _on = _on, on
    try:
        yield
    finally:
        _on = before


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FP32 = torch.float32


def _plain_fp32_cpu(t) -> bool:
    # ``type(t)`` rules out subclasses and non-tensors at once; ``is_cpu`` reads the tensor's
    # dispatch keys where ``t.device.type`` builds a device object; dtypes are singletons.
    return type(t) in _PLAIN and t.is_cpu and t.dtype is _FP32


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: plain (not a subclass) contiguous fp32 CPU
    tensors, outside torch.compile's tracing, with the kernels on and built. Asked for every
    operator call (trainer3d/cpu/ops.py): a loop, not a generator."""
    if not _on:
        return False
    for t in tensors:
        if not (type(t) in _PLAIN and t.is_cpu and t.dtype is _FP32 and t.is_contiguous()):
            return False
    return not torch.compiler.is_compiling() and library() is not None


def rotary_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """``usable`` for the rotary kernel, which reads x (seq, batch, heads, head_dim) with its first
    three dimensions in any memory order (the last one dense) and (seq, head_dim) tables."""
    if not _plain_fp32_cpu(x):
        return False
    shape = x.shape
    if len(shape) != 4 or shape[3] % 2 or x.stride(3) != 1:
        return False
    if cos.shape != (shape[0], shape[3]) or sin.shape != cos.shape:
        return False
    return usable(cos, sin)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x)) * weight and 1/rms, shaped (..., 1) as the composition's."""
    dim = x.shape[-1]
    y = torch.empty_like(x)
    rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    _lib.t3d_rms_norm_forward(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), x.numel() // dim, dim,
                              eps, torch.get_num_threads())
    return y, rstd


def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      need_x: bool, need_weight: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    dim = x.shape[-1]
    rows = x.numel() // dim
    gx = torch.empty_like(x) if need_x else None
    gw = torch.empty_like(weight) if need_weight else None
    scratch = torch.empty(-(-rows // NORM_BLOCK), dim) if need_weight else None
    _lib.t3d_rms_norm_backward(grad_y.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), _ptr(gx), _ptr(gw),
                               _ptr(scratch), rows, dim, torch.get_num_threads())
    return gx, gw


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x (seq, batch, heads, head_dim) rotated by the (seq, head_dim) tables, forward (sign 1) or
    back (-1); x may be any permutation of the first three dimensions' memory (the gradient
    reaching RoPE is attention's, in (batch, heads, seq) order), the result is contiguous."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # a size argument is parsed slower
    seq, batch, heads, hd = x.shape
    s_seq, s_batch, s_head, _ = x.stride()
    _lib.t3d_rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), seq, batch, heads, hd,
                    s_seq, s_batch, s_head, sign, torch.get_num_threads())
    return out


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b."""
    prod = torch.empty_like(a)
    _lib.t3d_swiglu_forward(a.data_ptr(), b.data_ptr(), prod.data_ptr(), a.numel(), torch.get_num_threads())
    return prod


def swiglu_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, need_prod: bool, need_inputs: bool):
    """silu(a) * b (for the weight's gradient), and the gradients of a and b for ``grad``, the
    gradient of that product; each None where not asked for."""
    prod = torch.empty_like(a) if need_prod else None
    ga = torch.empty_like(a) if need_inputs else None
    gb = torch.empty_like(b) if need_inputs else None
    _lib.t3d_swiglu_backward(grad.data_ptr(), a.data_ptr(), b.data_ptr(), _ptr(prod), _ptr(ga), _ptr(gb), a.numel(),
                             torch.get_num_threads())
    return prod, ga, gb
