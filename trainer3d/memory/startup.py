"""ZeRO-2/3's start-up peak: what a rank holds while it builds its model and optimizer.

The model is sharded on the meta device before anything is allocated
(trainer3d/parallel/zero/fsdp.py, ``shard_and_materialise``), so start-up holds, in order:

1. the rank's fp32 parameter shards (FSDP2 pads each to ceil(rows / n) rows: 4 bytes per
   element of the padded shard, ``ModelStateBytes.sharded``);
2. while each parameter is filled, that parameter's rows drawn on the host (4 bytes per
   element of its shard) and the init stream's buffer of at most ``CHUNK`` fp32 values, no
   more than the tensor's (trainer3d/model/normal_stream.py), freed before the next parameter; a device of its own
   takes the rows straight into the shard (``copy_`` from host memory), holding nothing more;
3. Adam's two moments over the rank's real rows and the step counter (allocated by the
   optimizer after the fill, in the memory the fill freed).

So the peak is the shards plus the larger of (2) and (3): 12 bytes per parameter / n and
no more, where the ZeRO paper's 16 counts the gradient shard a step adds (Rajbhandari et
al. 2020, sec. 5). Measured against this by tests/multirank/test_zero3_init.py. Stages 0/1
return nothing here: their start-up holds their step's model states at most.
"""

import functools
from math import prod
from typing import Sequence, Tuple

from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import zero_shards
from trainer3d.memory.states import ModelStateBytes
from trainer3d.model.normal_stream import CHUNK

FP32 = 4
STREAM_BYTES = FP32 * CHUNK
"""The init stream's largest buffer (trainer3d/model/normal_stream.py)."""


def startup_bytes(cfg: Config, shapes: Sequence[Tuple[int, ...]], states: ModelStateBytes,
                  same_memory: bool) -> Tuple[int, int]:
    """(device, host) bytes at a ZeRO-2/3 rank's start-up peak, for its parameter ``shapes``
    and model ``states`` (trainer3d/memory/states.py); (0, 0) for stages 0/1.
    ``same_memory``: CPU ranks, where host and device are one memory (all of it is "device")."""
    p = cfg.parallel
    if p.zero_stage < 2 or not shapes:
        return 0, 0
    largest, whole = _largest(tuple(shapes), zero_shards(p))  # FSDP2's shard group: dp x cp, HSDP's dp_shard x cp
    stream = min(STREAM_BYTES, FP32 * p.tp * whole)  # a tp slice streams the full tensor
    drawn = FP32 * largest + stream  # on the host
    if p.offload_optimizer:  # shards, their fill and the moments all on the host
        moments = states.host - 2 * FP32 * states.sharded  # 8 bytes a real element and the step counter
        host = FP32 * states.sharded + max(drawn, moments)
        return (states.optimizer + host, 0) if same_memory else (states.optimizer, host)
    if same_memory:
        return states.params + max(drawn, states.optimizer), 0
    return states.params + states.optimizer, drawn


@functools.lru_cache(maxsize=1024)
def _largest(shapes: Tuple[Tuple[int, ...], ...], n: int) -> Tuple[int, int]:
    """Elements of the largest of ``shapes``' shards over ``n`` ranks (FSDP2 pads each to
    ceil(rows / n) rows), and of the largest tensor (cached: the planner asks for the same rank's
    shapes over every ZeRO-2/3 layout it tries, trainer3d/plan/search.py)."""
    return max(-(-s[0] // n) * prod(s[1:]) for s in shapes), max(prod(s) for s in shapes)
