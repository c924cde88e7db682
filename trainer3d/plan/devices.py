"""What a rank can do, as data: device presets with their sources, or a calibration file.

A GPU preset's rates are *achievable* figures: the dense data-sheet peaks and memory
bandwidth times ``ACHIEVABLE`` (0.8: a bf16 8192^3 ``torch.mm`` measured 790 TFLOP/s on an
H100 SXM 80GB with torch 2.11, of the 989 the data sheet gives), and collective bus
bandwidths a little under the links' per-direction figures (nccl-tests reports bus
bandwidth in those units: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). A GPU
preset's blocks are timed by shape from its ``kernels`` (trainer3d/plan/kernels.py: GEMMs
anchored on a measured matmul rate, attention kernels, launches); its flat ``matmul_tflops``
times only what has no shape there. ``cpu`` is a
placeholder: ``python -m trainer3d.plan --calibrate`` measures this machine
(trainer3d/plan/calibrate.py) and ``cluster.gpu=calibrated`` reads what it wrote.

On a GPU every rank owns its device, so a node's throughput grows with its ranks. CPU ranks
share the node's cores (trainer3d/rank/body.py gives each cores // ranks threads, at least
one), so the calibration also measures the node's total matmul rate with 1, 2, 4, 8 ranks
busy at once: the step-time model bounds a step by the node's work over that rate.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from trainer3d.plan.kernels import KERNELS, Kernels

DEFAULT_CALIBRATION = "~/.cache/trainer3d/calibration.json"


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    """Memory of one device (GPU), or of the node, shared by its ranks (``shared_memory``)."""
    reserved_gib: float
    """Held back for what the accounting does not count: CUDA context, NCCL, fragmentation."""
    matmul_tflops: Dict[str, float]
    """Achievable dense matmul TFLOP/s of one rank computing alone, by train.dtype."""
    memory_gbps: float
    """Achievable memory bandwidth of one rank (elementwise ops, the optimizer), GB/s."""
    intra_gbps: float
    """Collective bus bandwidth per rank inside a node (tensor parallelism), GB/s."""
    inter_gbps: float
    """... between nodes (data and pipeline parallelism across nodes), GB/s."""
    latency_us: float
    """Cost of one hop of a ring collective or one send/receive, microseconds."""
    source: str
    elementwise_gbps: float = 0.0
    """Rate of a block's elementwise work (norms, RoPE, SwiGLU, softmax) in the model's bytes
    (step_time.py); 0: ``memory_gbps``. On CPUs these ops run far below the memory bandwidth."""
    pipeline_action_us: float = 0.0
    """Host time of one pipeline action (a micro-batch's forward or backward on a stage: the
    schedule's bookkeeping and its send/receive calls); measured on CPUs, hidden behind the
    device's work on GPUs."""
    layer_overhead_us: float = 0.0
    """Host time per block forward + backward that does not shrink with its size (op dispatch);
    hidden by asynchronous kernel launches on GPUs, measured on CPUs."""
    step_overhead_us: float = 0.0
    """Host time of one training step outside the blocks (data, loss and optimizer
    bookkeeping, metrics); hidden behind the device's work on GPUs, measured on CPUs through
    the engine at a negligible model size."""
    node_scaling: Dict[int, float] = field(default_factory=dict)
    """CPU: the node's total matmul rate with N ranks busy (each with cores // N threads, at
    least one), as a multiple of ``matmul_tflops`` (empty: each rank has its own device)."""
    shared_memory: bool = False
    latency_by_ranks: Dict[int, float] = field(default_factory=dict)
    """CPU: a hop's latency, microseconds, when N ranks share the node's cores and compute
    between their collectives (a peer may be waiting for a core), measured through the
    engine's tensor-parallel collectives at a negligible model size; missing N: ``latency_us``."""
    cores: int = 0
    """CPU: cores per node, shared by its ranks (0: each rank has its own device)."""
    peak_tflops: Dict[str, float] = field(default_factory=dict)
    """The data sheet's dense peak by train.dtype, the denominator of MFU (empty: unknown, CPUs)."""
    kernels: Optional[Kernels] = None
    """GPU presets: GEMM, attention and launch costs by shape (trainer3d/plan/kernels.py);
    None: the block's matmuls run at ``matmul_tflops`` (CPUs, calibration files)."""
    action_by_ranks: Dict[int, float] = field(default_factory=dict)
    """CPU: ``pipeline_action_us`` when N ranks share the node's cores (a stage waits for its
    neighbour to get a core), measured through the engine at a negligible model size; missing
    N: ``pipeline_action_us``."""

    def node_rate(self, ranks: int) -> float:
        """The node's total throughput with ``ranks`` busy, in units of one rank alone."""
        if not self.node_scaling:
            return float(ranks)
        known = sorted(self.node_scaling)
        below = max([k for k in known if k <= ranks], default=known[0])
        return self.node_scaling[below]

    def latency(self, ranks: int) -> float:
        """Microseconds per hop with ``ranks`` on the node."""
        return _by_ranks(self.latency_by_ranks, ranks, self.latency_us)

    def pipeline_action(self, ranks: int) -> float:
        """Microseconds of a pipeline action's host time with ``ranks`` on the node."""
        return _by_ranks(self.action_by_ranks, ranks, self.pipeline_action_us)

    def rank_speed(self, ranks: int) -> float:
        """One rank's speed computing alone, in units of ``matmul_tflops`` (one thread on CPUs):
        with fewer ranks than cores a rank runs cores // ranks threads (between one thread and
        the whole node alone, ``node_rate(1)``, linearly)."""
        threads = max(1, self.cores // ranks) if self.cores else 1
        if threads == 1:
            return 1.0
        return 1.0 + (self.node_rate(1) - 1.0) * (threads - 1) / (self.cores - 1)

    def usable_bytes(self, ranks_per_node: int) -> float:
        """Memory one rank may use."""
        usable = (self.memory_gib - self.reserved_gib) * 2 ** 30
        return usable / ranks_per_node if self.shared_memory else usable


def _by_ranks(table: Dict[int, float], ranks: int, default: float) -> float:
    """The figure measured with the most ranks, at most ``ranks``, on the node; else ``default``."""
    known = [k for k in table if k <= ranks]
    return table[max(known)] if known else default


ACHIEVABLE = 0.8
"""Of a data-sheet rate: a bf16 8192^3 torch.mm measured 790 of the 989 TFLOP/s of an H100 SXM."""


def _gpu(name: str, memory_gib: float, bf16_tflops: float, fp32_tflops: float, hbm_tbps: float,
         intra_gbps: float, inter_gbps: float, sheet: str, kernels: Kernels) -> Device:
    """A GPU from its data sheet (dense peaks, memory, links) at ACHIEVABLE of each rate."""
    rates = {"bf16": ACHIEVABLE * bf16_tflops, "fp16": ACHIEVABLE * bf16_tflops, "fp32": ACHIEVABLE * fp32_tflops}
    peaks = {"bf16": bf16_tflops, "fp16": bf16_tflops, "fp32": fp32_tflops}
    return Device(name, memory_gib=memory_gib, reserved_gib=4, matmul_tflops=rates, memory_gbps=ACHIEVABLE * hbm_tbps * 1e3,
                  intra_gbps=intra_gbps, inter_gbps=inter_gbps, latency_us=10, source=f"NVIDIA data sheet: {sheet}",
                  peak_tflops=peaks, kernels=kernels)


# intra: NCCL bus bandwidth a little under the NVLink (PCIe) per-direction figure;
# inter: one InfiniBand NIC per GPU as in DGX systems (H100: 400 Gb/s, A100: 200 Gb/s).
PRESETS: Dict[str, Device] = {
    "h100-sxm": _gpu("h100-sxm", 80, 989, 67, 3.35, 360, 45, "989 TFLOP/s bf16, 67 fp32, 80 GB HBM3 3.35 TB/s, "
                     "NVLink4 450 GB/s per direction; one 400 Gb/s NIC per GPU", KERNELS["h100"]),
    "h100-pcie": _gpu("h100-pcie", 80, 756, 51, 2.0, 50, 22, "756 TFLOP/s bf16, 51 fp32, 80 GB HBM2e 2.0 TB/s, "
                      "PCIe Gen5 64 GB/s per direction; one 200 Gb/s NIC per GPU", KERNELS["h100-pcie"]),
    "h200": _gpu("h200", 141, 989, 67, 4.8, 360, 45, "989 TFLOP/s bf16, 67 fp32, 141 GB HBM3e 4.8 TB/s, "
                 "NVLink4 450 GB/s per direction; one 400 Gb/s NIC per GPU", KERNELS["h200"]),
    "a100-80g": _gpu("a100-80g", 80, 312, 19.5, 2.0, 230, 22, "312 TFLOP/s bf16, 19.5 fp32, 80 GB HBM2e 2.0 TB/s, "
                     "NVLink3 300 GB/s per direction; one 200 Gb/s NIC per GPU", KERNELS["a100"]),
    "a100-40g": _gpu("a100-40g", 40, 312, 19.5, 1.555, 230, 22, "312 TFLOP/s bf16, 19.5 fp32, 40 GB HBM2 1.6 TB/s, "
                     "NVLink3 300 GB/s per direction; one 200 Gb/s NIC per GPU", KERNELS["a100-40g"]),
    "cpu": Device(
        "cpu", memory_gib=16, reserved_gib=2, matmul_tflops={"fp32": 0.09, "bf16": 0.4, "fp16": 0.002},
        memory_gbps=50, elementwise_gbps=8, intra_gbps=1.0, inter_gbps=0.1, latency_us=100, layer_overhead_us=500,
        pipeline_action_us=300,
        node_scaling={1: 1.8, 2: 1.9, 4: 1.9, 8: 1.9}, shared_memory=True, cores=2,
        source="placeholder (a 2-core x86 machine): run python -m trainer3d.plan --calibrate"),
}


def load_calibration(path: str) -> Device:
    """The Device that ``--calibrate`` measured and saved to ``path``."""
    file = Path(os.path.expanduser(path))
    if not file.is_file():
        raise FileNotFoundError(f"cluster.calibration={path} does not exist; run python -m trainer3d.plan "
                                "--calibrate first (or pick a preset: cluster.gpu=" + "|".join(PRESETS) + ")")
    data = json.loads(file.read_text())
    for key in ("node_scaling", "latency_by_ranks", "action_by_ranks"):
        data[key] = {int(k): v for k, v in data.get(key, {}).items()}
    if data.get("kernels"):  # a calibrated GPU preset (trainer3d/plan/calibrate_gpu.py)
        k = data["kernels"]
        data["kernels"] = Kernels(**{**k, "mamf_shape": tuple(k["mamf_shape"]),
                                     "flash_tflops": tuple(tuple(row) for row in k.get("flash_tflops", ()))})
    return Device(**data)


def device_for(gpu: str, calibration: str = DEFAULT_CALIBRATION) -> Device:
    """``cluster.gpu``: a preset name, or ``calibrated`` for the file ``--calibrate`` wrote."""
    if gpu == "calibrated":
        return load_calibration(calibration)
    if gpu not in PRESETS:
        raise ValueError(f"cluster.gpu={gpu} is not one of {', '.join(PRESETS)}, calibrated")
    return PRESETS[gpu]
