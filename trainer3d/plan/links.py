"""How the GPUs' links carry a parallel group's collectives, for the step-time model
(step_time.py): which link a group crosses, what a ring all-gather over it takes (shared
with muon_cost.py), and what a collective overlapped with compute costs that compute."""

from trainer3d.plan.devices import Device


def gather_s(nbytes: float, n: int, gbps: float, latency_us: float) -> float:
    """A ring all-gather into (or a reduce-scatter out of) ``nbytes``."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / (gbps * 1e9) + (n - 1) * latency_us * 1e-6


def _link_gbps(device: Device, span: int, ranks_per_node: int, members_per_node: int = 1) -> float:
    """A group whose members lie ``span`` ranks apart end to end crosses nodes when wider than one.

    Across nodes, a group with several members on each node runs that many rings at once, one
    through each member's own NIC (NCCL's channels over the node's rails, every GPU of a DGX-like
    node with its NIC: Hu et al. 2025, "Demystifying NCCL", arXiv:2507.04786, sec. 3): the
    network's share grows with the members per node, up to what the links inside the node carry.
    A data-parallel group beside tp = 8 has one member per node (``inter_gbps``); FSDP over all
    of a node's 8 GPUs has eight."""
    if span <= ranks_per_node:
        return device.intra_gbps
    return min(device.intra_gbps, device.inter_gbps * max(1, members_per_node))


NCCL_CHANNELS = 32
"""Thread blocks a collective occupies, one SM each, while it runs: NCCL runs one block per
channel and opens up to 32 channels on NVLink nodes (``NCCL_DEBUG=INFO`` prints "32 coll
channels" at start-up on a DGX H100 or A100; NCCL_MAX_CTAS / NCCL_MIN_CTAS in NCCL's environment
variables page, docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html, set it). An
assumption where a node's log says otherwise."""


def overlap_cost(device: Device, hidden_s: float) -> float:
    """What a collective overlapped with compute costs the compute: its thread blocks hold
    ``NCCL_CHANNELS`` of the GPU's SMs for ``hidden_s``, so the kernels beside it run on the
    rest (Hu et al. 2025, "Demystifying NCCL", arXiv:2507.04786, sec. 3: a channel is one CUDA
    block on one SM). GPU presets only: CPU ranks' collectives run on threads of their own."""
    if device.kernels is None or hidden_s <= 0:
        return 0.0
    return hidden_s * min(1.0, NCCL_CHANNELS / device.kernels.sms)
