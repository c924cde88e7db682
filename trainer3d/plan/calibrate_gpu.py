"""``python -m trainer3d.plan --calibrate`` on a CUDA node: this GPU's preset, its rates measured.

A GPU preset (devices.py) carries data-sheet rates and a matmul rate measured elsewhere
(kernels.py: Stas Bekman's maximum-achievable-matmul table). A node may run slower — a lower
power cap (torchtitan's H100s at 500 W: github.com/pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md), other clocks, another memory — or faster. The
calibration keeps the preset's structure (tiles, attention, links between nodes) and replaces
what one node can measure in seconds:

- ``mamf_tflops``: the best of several bf16 matmuls at the preset's own ``mamf_shape``, so the
  GEMM model of kernels.py is anchored on this GPU's rate; the flat ``matmul_tflops`` scale by
  the same ratio (fp32 by a measured fp32 matmul);
- ``memory_gbps`` / ``hbm_gbps``: a 1 GiB device-to-device copy (read + write bytes over time);
- links (NVLink, the network) stay the preset's: measuring them needs every GPU of the node
  at once (nccl-tests' busbw, github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md);
  ``figures["intra_gbps"]``, where given, replaces the preset's.

``calibrated_device`` (a pure function of the preset and the figures) is what
``cluster.gpu=calibrated`` then reads back (devices.py: ``load_calibration``).
"""

import dataclasses
import datetime
import socket
from typing import Dict, Optional

import torch

from trainer3d.plan.devices import PRESETS, Device


def preset_for(device_name: str, memory_gib: float) -> Optional[str]:
    """The preset of a CUDA device's name (``torch.cuda.get_device_name``), or None."""
    name = device_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-pcie" if "PCIE" in name else "h100-sxm"
    if "A100" in name:
        return "a100-40g" if memory_gib < 60 else "a100-80g"
    return None


def calibrated_device(preset: Device, figures: Dict[str, float]) -> Device:
    """``preset`` with the measured ``figures`` (bf16_tflops at the preset's mamf_shape,
    fp32_tflops, hbm_gbps, and intra_gbps where measured) in place of its own."""
    kernels = preset.kernels
    ratio = figures["bf16_tflops"] / kernels.mamf_tflops
    rates = {"bf16": preset.matmul_tflops["bf16"] * ratio, "fp16": preset.matmul_tflops["fp16"] * ratio,
             "fp32": figures.get("fp32_tflops", preset.matmul_tflops["fp32"])}
    return dataclasses.replace(
        preset, name="calibrated", matmul_tflops=rates, memory_gbps=figures["hbm_gbps"],
        intra_gbps=figures.get("intra_gbps", preset.intra_gbps),
        kernels=dataclasses.replace(kernels, mamf_tflops=figures["bf16_tflops"], hbm_gbps=figures["hbm_gbps"]),
        source=f"{preset.name} preset calibrated: {figures.get('where', 'measured')}")


def device_record(device: Device) -> dict:
    """The Device as the JSON ``load_calibration`` reads."""
    return dataclasses.asdict(device)


def _timed_ms(work, repeats: int) -> float:
    """Milliseconds of the fastest of ``repeats`` runs of ``work`` on the current stream."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def matmul_tflops(m: int, n: int, k: int, dtype: torch.dtype, repeats: int = 10) -> float:
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    ms = _timed_ms(lambda: torch.mm(a, b, out=out), repeats)
    return 2.0 * m * n * k / (ms / 1e3) / 1e12


def hbm_gbps(nbytes: int = 2 ** 30, repeats: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _timed_ms(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / (ms / 1e3) / 1e9


def measure(preset: Device) -> Dict[str, float]:
    """This GPU's figures (device 0 of the process), seconds of work."""
    m, n, k = preset.kernels.mamf_shape
    return {"bf16_tflops": matmul_tflops(m, n, k, torch.bfloat16),
            "fp32_tflops": matmul_tflops(4096, 4096, 4096, torch.float32, repeats=3),
            "hbm_gbps": hbm_gbps(),
            "where": f"{torch.cuda.get_device_name(0)} on {socket.gethostname()}, torch {torch.__version__}, "
                     f"{datetime.datetime.now():%Y-%m-%d %H:%M}"}


def calibrate_cuda() -> dict:
    """The calibrated Device of this node's GPU 0, as JSON; refuses a GPU with no preset."""
    props = torch.cuda.get_device_properties(0)
    key = preset_for(props.name, props.total_memory / 2 ** 30)
    if key is None:
        raise SystemExit(f"trainer3d.plan --calibrate: no preset for {props.name} to calibrate "
                         f"(presets: {', '.join(k for k in PRESETS if k != 'cpu')}); add one to trainer3d/plan/devices.py")
    return device_record(calibrated_device(PRESETS[key], measure(PRESETS[key])))
