"""The planner's configuration: the training schema plus the cluster and the search space.

``PlanConfig`` extends the training ``Config`` (same groups, same ``validate()``), so
``python -m trainer3d.plan model=7b train.global_batch_size=1024 ...`` reads the model and
batch exactly as ``python -m trainer3d.train`` would, and the layout knobs it searches are
the training config's own (``parallel.*``, ``train.micro_batch_size``, ...). Hydra's
ConfigStore learns ``PlanConfig`` from trainer3d/plan/composed.py, where ``plan`` is composed.
"""

from dataclasses import dataclass, field
from typing import List

from trainer3d.config.schema import Config
from trainer3d.plan.devices import DEFAULT_CALIBRATION


@dataclass
class ClusterConfig:
    """The machines to plan for."""

    nodes: int = 1
    gpus_per_node: int = 8
    """Ranks per node: GPUs, or on CPU machines the ranks sharing the node's cores."""
    gpu: str = "h100-sxm"
    """A device preset (h100-sxm, h100-pcie, h200, a100-80g, a100-40g, cpu: trainer3d/plan/devices.py)
    or calibrated (the file ``python -m trainer3d.plan --calibrate`` wrote)."""
    calibration: str = DEFAULT_CALIBRATION
    """Where --calibrate writes this machine's figures and cluster.gpu=calibrated reads them."""
    attention: str = "flash"
    """The attention kernel timed and its saved bytes: flash (torch's SDPA on GPUs) | math (unfused:
    every score computed and kept, as torch's math SDPA or Megatron-LM 2021; trainer3d/plan/kernels.py)."""
    backend: str = "auto"
    """Collectives: auto (nccl on GPUs, gloo on CPUs) | nccl | gloo (ZeRO-1 reduces by reduce-scatter on nccl)."""
    host_memory_gb: float = 1024.0
    """Host memory per node, GiB, for the offloaded optimizer state of all its ranks
    (parallel.offload_optimizer); default: a DGX A100's 1 TB. 10% is kept for the OS, the
    data loaders and the page cache."""
    host_memory_gb_s: float = 200.0
    """The node's host memory bandwidth, GB/s, that its ranks' host AdamW steps share (the step is
    memory-bound: docs/offload.md); default: about two thirds of two 8-channel DDR4-3200 sockets."""
    pcie_gb_s: float = 25.0
    """Each GPU's host link, GB/s per direction, for the offloaded gradients and parameters;
    default: PCIe 4.0 x16 as achieved (32 GB/s raw)."""


@dataclass
class SearchConfig:
    """What the planner tries, and how much it prints."""

    top: int = 5
    """Layouts printed, fastest first, each with its training command."""
    micro_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    zero_stages: List[int] = field(default_factory=lambda: [0, 1, 2, 3])
    virtual_stages: List[int] = field(default_factory=lambda: [1, 2, 4])
    """Model chunks per pipeline rank; above 1 with interleaved_1f1b and zb1p. (GPipe is never
    proposed: it has 1F1B's bubble and holds every micro-batch's activations.)"""
    schedules: List[str] = field(default_factory=lambda: ["1f1b", "interleaved_1f1b"])
    """Pipeline schedules tried (pp > 1): 1f1b, interleaved_1f1b, and the zero-bubble zb1p, zbv,
    dualpipev (zbv and dualpipev with 2 stages per rank; docs/planning.md compares them)."""
    sequence_parallel: List[bool] = field(default_factory=lambda: [False, True])
    recompute: List[bool] = field(default_factory=lambda: [False, True])
    offload: bool = True
    """Try ``parallel.offload_optimizer`` (every ZeRO stage) for a layout that does not fit the
    device without it; proposed only where it makes the layout fit."""
    context_parallel_from: int = 16384
    """train.seq_len from which context parallelism is tried (cp over the powers of two up to
    ``context_parallel_max``, within what tp leaves); shorter sequences search cp = 1 only."""
    context_parallel_max: int = 16
    """The largest cp tried."""


@dataclass
class PlanOptions:
    """What the planner does."""

    evaluate: bool = False
    """Evaluate exactly the layout of the overrides (``parallel.*``, ``train.micro_batch_size``,
    ``train.activation_checkpointing``, ...) instead of searching: its memory per bounding rank,
    its step-time terms, and a last line of JSON (trainer3d/plan/evaluate.py)."""


@dataclass
class PlanConfig(Config):
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
