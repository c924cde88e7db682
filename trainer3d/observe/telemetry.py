"""What a rank measures about itself for the metrics: memory, time in communication, its peak.

Everything here is host-side and cheap; nothing reads a device tensor. ``observe/metrics.py``
gathers these per-rank figures once per logging interval.

- ``model_state_bytes``: bytes of every tensor storage behind the model's parameters (and
  their gradients) and the optimizer's declared state (``ZeroOptimizer.state_tensors``),
  each storage counted once however many views share it — the measured counterpart of
  ``trainer3d.memory.states``.
- ``process_memory``: on CPU the process's resident set (peak, from the kernel); on GPU
  torch's peak allocated and reserved bytes (allocator statistics, no sync).
- ``CommTimer``: wall time the host spends inside the step's communication calls (the dp
  gradient reduction's wait, the sequence-parallel sync, the global-norm all-reduce). On
  gloo these calls block until the data has moved, so this is the communication the step
  did not overlap; on NCCL they return once queued, so it counts host waits only (device
  time in kernels needs a profiler). Pipeline send/recv happen inside torch's schedule and
  show up as the pipeline ``bubble`` instead.
- ``measured_peak_tflops``: for devices without a data-sheet figure (CPUs), the best fp32
  matmul rate this rank reaches on its own threads, measured once at start-up: MFU on a
  CPU is then "fraction of what a dense matmul gets here", which makes layouts comparable.
"""

import resource
import sys
import time
from contextlib import contextmanager
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from trainer3d.model.flops import peak_tflops
from trainer3d.parallel.zero.optimizer import ZeroOptimizer
from trainer3d.optim.mixed_precision import DTYPES


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once;
    a DTensor counts its local shard; meta tensors count nothing)."""
    storages: Dict[int, int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


def model_state_bytes(chunks: Iterable[nn.Module], optimizer: ZeroOptimizer) -> int:
    """Parameters, their gradients and the optimizer's state, as tensor storage bytes on this
    rank right now: the model's parameters as it holds them at this moment (FSDP's gathered
    ones included while they live) and every tensor the optimizer declares it holds."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    held = [t for tensors in optimizer.state_tensors().values() for t in tensors]
    return storage_bytes([*params, *grads, *held])


def process_memory(device: torch.device) -> Dict[str, float]:
    """Peak memory of this rank's process, in bytes."""
    if device.type == "cuda":
        return {"mem_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
                "mem_reserved_bytes": float(torch.cuda.max_memory_reserved(device))}
    return {"mem_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> float:
    """This process's peak resident set. On Linux ``VmHWM`` of /proc/self/status: getrusage's
    ``ru_maxrss`` also keeps the parent's resident set from before exec (fs/exec.c, exec_mmap
    folds the old image's high-water mark into the process's maxrss), so a rank started by
    a launcher holding 300 MB would report at least 300 MB. Elsewhere ``ru_maxrss`` (macOS:
    bytes)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)


class CommTimer:
    """Accumulates host time spent in communication calls: ``with timer: ...``."""

    def __init__(self):
        self.steps = []
        self._current = 0.0

    @contextmanager
    def __call__(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self._current += time.perf_counter() - started

    def end_step(self) -> None:
        self.steps.append(self._current)
        self._current = 0.0

    def pop(self):
        """This interval's per-step seconds (then forgotten)."""
        steps, self.steps = self.steps, []
        return steps


def measured_peak_tflops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 768,
                         repeats: int = 10) -> float:
    """Best-of-``repeats`` dense matmul TFLOP/s on ``device`` after two warm-up products: 2 +
    ``repeats`` products of 2 ``size``³ FLOPs each (11 GFLOPs at the defaults; its CPU time on a
    CPU rank is that over the core's rate). On a loaded machine this under-estimates."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size ** 3 / best / 1e12


def resolve_peak_tflops(configured: Optional[float], device: torch.device, dtype: str) -> float:
    """``train.peak_tflops`` if set, else the device's data-sheet peak, else measured here."""
    if configured:
        return float(configured)
    if device.type == "cuda":
        known = peak_tflops(torch.cuda.get_device_name(device), dtype)
        if known:
            return known
    return measured_peak_tflops(device, DTYPES[dtype] if device.type == "cuda" else torch.float32)
