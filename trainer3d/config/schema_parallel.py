"""The layout section of the run's schema (``parallel.*``): degrees, ZeRO stage, pipeline
schedule, backend and timeouts. Part of ``trainer3d.config.schema``, which re-exports the class
and registers the whole schema with Hydra; ``trainer3d.config.validate`` holds the rules between
its fields and the rest of the run.
"""

from dataclasses import dataclass
from typing import List, Optional


V_SCHEDULES = ("zbv", "dualpipev")
"""Pipeline schedules that place two stages per rank in a V (trainer3d/parallel/pipeline/stages.py)."""


@dataclass
class ParallelConfig:
    """The layout. World size = tp * cp * pp * dp; rank order is TP fastest, then CP, then DP, then PP."""

    tp: int = 1
    """Tensor-parallel degree (Megatron-style column/row split inside each layer)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    dp: int = 1
    """Data-parallel degree (model replicas, each taking a slice of the global batch)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (load-balanced chunks, exact
    causal attention across them; trainer3d/parallel/context/). Does not multiply the batch;
    needs train.seq_len divisible by 2 * cp."""
    cp_attention: str = "ring"
    """How attention reaches the other cp ranks' keys and values: ring (blocks passed around a
    ring with send/recv, overlapped with compute) | all_gather (all at once; faster for short
    sequences, docs/context_parallel.md)."""
    zero_stage: int = 0
    """0: replicated optimizer; 1: optimizer state sharded over dp; 2/3 (pp == 1 only): FSDP2."""
    dp_shard: Optional[int] = None
    """ZeRO-2/3 only: shard parameters, gradients and optimizer state over groups of dp_shard
    neighbouring dp ranks and replicate them over the dp / dp_shard groups (HSDP: FSDP2 on a 2-D
    (dp_replicate, dp_shard) mesh). Must divide dp; null: dp_shard = dp (full sharding).
    docs/parallelism.md, "Hybrid sharding"."""
    ep: int = 1
    """Expert-parallel degree (model.moe.num_experts > 0): each MoE block's routed experts split
    over ep ranks carved out of the dp x cp group (Megatron-Core's expert-data-parallel scheme);
    must divide dp x cp and model.moe.num_experts. docs/moe.md."""
    offload_optimizer: bool = False
    """ZeRO-Offload: this rank's fp32 master weights and AdamW moments live in host memory
    (pinned on CUDA) and the AdamW step runs on the host's cores. Stages 0/1: the device keeps
    the train.dtype parameters and the fp32 gradient buckets, whose owned slices go to the host
    as backward finishes each (parallel/zero/offload.py); stages 2/3 (pp == 1): FSDP2's
    CPUOffloadPolicy, the parameter and gradient shards on the host too
    (parallel/zero/fsdp_offload.py). docs/offload.md."""
    sequence_parallel: bool = False
    """Shard norm regions along the sequence across tp (needs tp > 1)."""
    pp_schedule: str = "1f1b"
    """1f1b | gpipe | interleaved_1f1b | zb1p | zbv | dualpipev. The last three are zero-bubble
    schedules (weight gradients computed apart from input gradients, filling the bubble;
    docs/parallelism.md): zb1p interleaves ``pp_virtual_stages`` stages per rank as
    interleaved_1f1b does, zbv and dualpipev place exactly 2 per rank in a V."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved_1f1b and zb1p: any; zbv and dualpipev: 2)."""
    pp_layers: Optional[List[int]] = None
    """Layers per stage, e.g. [3, 5]; default: as even as possible."""
    bucket_mb: float = 25.0
    """Size of the gradient-reduction buckets over dp, in MiB."""
    zero_reduce: str = "auto"
    """How ZeRO-1 reduces gradients: all_reduce | reduce_scatter | auto (all_reduce on gloo, reduce_scatter on NCCL)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with GPUs, else gloo) | gloo | nccl."""
    timeout_s: float = 120.0
    """The training step's collective timeout: a dead or stuck rank ends the job after this long
    instead of hanging."""
    init_timeout_s: float = 1200.0
    """The timeout of start-up (rendezvous, building the model, the first step with its
    compilation, the first evaluation and the step after it, which compile and infer shapes
    again) and of checkpoint saves and loads, which may wait on a slow shared filesystem."""


def zero_shards(p: ParallelConfig) -> int:
    """How many ranks hold distinct shards of the ZeRO state: dp x cp, or dp_shard x cp under
    HSDP (zero_stage 2/3 with dp_shard set); the state is replicated over the rest of dp."""
    shard = p.dp_shard if p.zero_stage >= 2 and p.dp_shard is not None else p.dp
    return shard * p.cp
