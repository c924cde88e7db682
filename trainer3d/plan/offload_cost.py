"""The offloaded optimizer's term of the step-time model (step_time.py): what one rank's
``parallel.offload_optimizer`` costs a step beyond what backward hides, on ZeRO-1's flat
offload (parallel/zero/offload.py) and on FSDP2's CPUOffloadPolicy (ZeRO-2/3,
parallel/zero/fsdp_offload.py).
"""

from dataclasses import dataclass

from trainer3d.config.schema import Config
from trainer3d.memory.activations import FP32
from trainer3d.memory.states import BYTES, ModelStateBytes
from trainer3d.plan.micro_batch_time import RankTimes

HOST_ADAMW_BYTES = 32  # the host kernel: read master, grad, moments; write them back (the gradient divided in place)


@dataclass(frozen=True)
class HostLink:
    """What the offloaded optimizer's time depends on (``cluster.pcie_gb_s``, ``cluster.host_memory_gb_s``)."""

    pcie_gbps: float = 25.0
    host_gbps: float = 200.0


def offload_s(cfg: Config, states: ModelStateBytes, backward: float, node_ranks: int, link: HostLink) -> float:
    """One rank's offloaded-optimizer time per step not hidden (parallel/zero/offload.py): each
    bucket's owned fp32 gradients leave as its reduction is launched, during the last
    micro-batch's backward but for the last bucket; the host AdamW over the owned elements at
    this rank's share of the host bandwidth; the updated ``train.dtype`` slice back before
    the all-gather."""
    owned = states.offloaded
    if not owned:
        return 0.0
    b = BYTES[cfg.train.dtype]
    pcie = link.pcie_gbps * 1e9
    to_host = FP32 * owned / pcie
    share = min(1.0, cfg.parallel.bucket_mb * 2 ** 20 / max(1, states.grads))
    exposed = to_host * share + max(0.0, to_host * (1 - share) - backward)
    cast = (FP32 + b) if b != FP32 else 0  # the bf16/fp16 copy for the way back, made on the host
    host_step = (HOST_ADAMW_BYTES + cast) * owned / (link.host_gbps * 1e9 / node_ranks)
    return exposed + host_step + b * owned / pcie


def fsdp_offload_s(cfg: Config, states: ModelStateBytes, times: RankTimes, node_ranks: int,
                   link: HostLink) -> float:
    """One rank's ZeRO-2/3 offload time per step not hidden (parallel/zero/fsdp_offload.py):
    each micro-batch copies every unit's fp32 shard up before its all-gather (stage 3: again
    for backward), overlapped with the micro-batch's compute, and every reduce-scattered fp32
    gradient shard down. The first micro-batch's copies down overlap its backward (pinned,
    non-blocking); a later one's block the host, which adds it into the gradient it holds
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``foreach_reduce``): that copy
    and the sum (12 bytes of host traffic an element) are exposed. Then the host AdamW over the
    real rows at this rank's share of the host bandwidth."""
    if not states.offloaded:
        return 0.0
    m, pcie = cfg.train.grad_accum_steps, link.pcie_gbps * 1e9
    host = link.host_gbps * 1e9 / node_ranks
    shard = FP32 * states.sharded
    up = (2 if cfg.parallel.zero_stage == 3 else 1) * shard / pcie
    down = shard / pcie
    per_micro = max(0.0, up - times.forward - times.backward)
    accumulate = (m - 1) * (down + 3 * shard / host)
    return m * per_micro + max(0.0, down - times.backward) + accumulate + HOST_ADAMW_BYTES * states.offloaded / host
