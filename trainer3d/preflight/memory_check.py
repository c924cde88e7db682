"""Memory before launch: a run whose estimated peak does not fit is refused before any rank
allocates, naming the estimate, the limit and the knobs.

The estimate is the dry run's own accounting (``dry_run=true``; trainer3d/memory/peak.py:
model states, saved activations at the schedule's peak, pipeline buffers, the largest
transient) of every pipeline rank. The limit: for CUDA ranks the smallest total memory of
the GPUs they get, per rank; for CPU ranks this host's physical memory (MemTotal), shared by
all of them, so the ranks' estimates are summed. With ``parallel.offload_optimizer`` the
offloaded state is host memory: CUDA ranks are also held, summed, to this host's memory for
it; CPU ranks count it in their sum (host and device are the same memory). A background
checkpoint (``checkpoint.async_save``) copies each rank's state into host memory and keeps the
copy (trainer3d/memory/staged.py): counted the same way, held to the host's memory for CUDA
ranks and in the CPU ranks' sum. It runs for the local launcher, where the
ranks start on this machine; ``launcher.check_memory=false`` launches anyway (the estimate
leaves out the framework's own memory — CUDA context, NCCL, the allocator's slack — so a
refused run does not fit; a run that passes may still not).

The check itself runs in bounded memory whatever the config declares: a lower bound of the
model states (parameter count x bytes per parameter, from one block's shapes times the
stage's layer count: arithmetic, no list per layer) is compared first, so a config declaring
a million layers is refused for the cost of building one block on the meta device; only a
run whose bound fits is accounted term by term.
"""

import os
from dataclasses import dataclass
from math import prod
from typing import List, Optional

import torch

from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import zero_shards
from trainer3d.config.device import uses_cuda, visible_gpus
from trainer3d.memory.moe import moe_layers
from trainer3d.memory.peak import rank_memory
from trainer3d.memory.states import BYTES, format_bytes, model_shapes
from trainer3d.parallel.pipeline.placement import holds_embedding
from trainer3d.parallel.pipeline.stages import n_stages, stage_layer_ranges, stages_of_rank

KNOB = "launcher.check_memory=false"
FIXES = ("shrink the model or the batch (train.micro_batch_size, train.seq_len), spread it (parallel.tp, "
         "parallel.pp, parallel.dp with parallel.zero_stage, train.activation_checkpointing)")


@dataclass
class Estimate:
    per_rank: List[int]
    """Bytes of each pipeline rank (tp rank 0, dp rank 0)."""
    exact: bool
    """False: a lower bound of the model states alone."""
    detail: str = ""


def rank_parameters(cfg: Config, pp_rank: int) -> int:
    """Parameters one tp rank of ``pp_rank`` holds, by arithmetic over one block's shapes of each kind."""
    shapes = model_shapes(cfg.model, cfg.parallel.tp)
    ranges = stage_layer_ranges(cfg.model.n_layers, n_stages(cfg), cfg.parallel.pp_layers)
    last = len(ranges) - 1
    before, after, dense, moe = (sum(prod(s) for s in part)
                                 for part in (shapes.before, shapes.after, shapes.block, shapes.moe_block))
    total = 0
    for stage in stages_of_rank(pp_rank, cfg.parallel.pp, cfg.parallel.pp_virtual_stages, cfg.parallel.pp_schedule):
        experts = moe_layers(cfg, stage) if cfg.model.moe.num_experts else 0  # a dense model: no walk of its layers
        total += experts * moe + (len(ranges[stage]) - experts) * dense
        tied, pp, schedule = cfg.model.tie_embeddings, cfg.parallel.pp, cfg.parallel.pp_schedule
        total += before if holds_embedding(stage, len(ranges), tied, pp, schedule) else 0
        total += after if stage == last else 0
    return total


def states_lower_bound(cfg: Config, pp_rank: int) -> int:
    """Model-state bytes the rank holds at least (trainer3d/memory/states.py's table, with
    every padded length at its unpadded minimum)."""
    psi, b, n = rank_parameters(cfg, pp_rank), BYTES[cfg.train.dtype], zero_shards(cfg.parallel) // cfg.parallel.cp
    master = 4 if b != 4 else 0
    stage = cfg.parallel.zero_stage
    if cfg.parallel.offload_optimizer:  # masters and moments on the host; stages 2/3 all their shards too
        return (b + 4) * psi if stage < 2 else (b * psi if stage == 2 else 0)
    if stage == 0:
        return (b + 4 + master + 8) * psi
    if stage == 1:
        return (b + 4) * psi + (master + 8) * psi // n
    return 16 * psi // n + (b * psi if stage == 2 else 0)


def host_lower_bound(cfg: Config, pp_rank: int) -> int:
    """Host bytes of the offloaded optimizer state the rank holds at least (0 without offload):
    16 per owned parameter, + the bf16/fp16 cast for stages 0/1 (stages 2/3: the parameter,
    gradient and moment shards, 16 bytes per parameter of the shard)."""
    p, b = cfg.parallel, BYTES[cfg.train.dtype]
    if not p.offload_optimizer:
        return 0
    owned = rank_parameters(cfg, pp_rank) // (zero_shards(p) if p.zero_stage >= 1 else 1)
    return (16 + (b if b != 4 and p.zero_stage < 2 else 0)) * owned


def estimate(cfg: Config, limit: int, ranks_summed: bool) -> Estimate:
    """The pipeline ranks' peaks: the lower bound where it alone exceeds ``limit``, else exact.
    ``ranks_summed`` (CPU ranks): the offloaded host state counted in, the same memory."""
    p = cfg.parallel
    host = [host_lower_bound(cfg, r) if ranks_summed else 0 for r in range(p.pp)]
    bound = [states_lower_bound(cfg, r) + h for r, h in zip(range(p.pp), host)]
    if (sum(bound) * p.tp * p.cp * p.dp if ranks_summed else max(bound)) > limit:
        return Estimate(bound, exact=False)
    mems = [rank_memory(cfg, r, cuda=not ranks_summed) for r in range(p.pp)]  # summed: CPU ranks
    worst = max(mems, key=lambda m: m.total)
    detail = (f"pp rank {worst.pp_rank}: model states {format_bytes(worst.states.total)}, activations "
              f"{format_bytes(worst.activation_bytes)}, pipeline buffers {format_bytes(worst.buffer_bytes)}, "
              f"transient {format_bytes(worst.transient_bytes)}"
              + (f", offloaded optimizer state {format_bytes(worst.host)}" if ranks_summed and worst.host else "")
              + (f", a background checkpoint's host copy {format_bytes(worst.staged)} (checkpoint.async_save)"
                 if ranks_summed and worst.staged else ""))
    if not ranks_summed:
        return Estimate([m.total for m in mems], exact=True, detail=detail)
    # CPU ranks: host and device one memory, ZeRO-2/3's start-up peak counted there (memory/startup.py)
    # the staged copy is taken at the first background save, after start-up's peak has passed
    return Estimate([max(m.step_total + m.host + m.staged, m.startup_same_memory) for m in mems], exact=True,
                    detail=detail)


def host_problems(cfg: Config, host_bytes: Optional[int]) -> List[str]:
    """CUDA ranks: one line if what they keep in host memory does not fit this host: the
    offloaded optimizer state, and a background checkpoint's copy of their state (pinned)."""
    p = cfg.parallel
    mems = [rank_memory(cfg, r) for r in range(p.pp)]
    ranks = p.tp * p.cp * p.dp
    offloaded, staged = (sum(m.host for m in mems) * ranks, sum(m.staged for m in mems) * ranks)
    limit = host_memory() if host_bytes is None else host_bytes
    if offloaded + staged <= limit:
        return []
    parts = [f"the offloaded optimizer state {format_bytes(offloaded)}" if offloaded else "",
             f"a background checkpoint's copy {format_bytes(staged)}" if staged else ""]
    fixes = [f for f, on in (("parallel.offload_optimizer=false", offloaded),
                             ("checkpoint.async_save=false (a save then stops the loop)", staged)) if on]
    return [f"the host memory of the {ranks * p.pp} rank(s), {' and '.join(x for x in parts if x)}, is "
            f"{format_bytes(offloaded + staged)}, more than this host's {format_bytes(limit)}; set "
            f"{' or '.join(fixes)}, {FIXES}; or set {KNOB} to launch anyway"]


def host_memory() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_problems(cfg: Config, world_size: int, device_bytes: Optional[int] = None,
                    host_bytes: Optional[int] = None) -> List[str]:
    """One line if the validated ``cfg`` does not fit this machine, else []: asked where its
    ranks start here (trainer3d/preflight/refusal.py ``estimate_problems`` decides whether the
    check runs). ``device_bytes``/``host_bytes``: the limits (default: this machine's)."""
    count = visible_gpus() if device_bytes is None else max(1, world_size)
    if uses_cuda(cfg, count > 0):
        if device_bytes is None:
            if count < world_size:
                return []  # machine_problems names that
            device_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(world_size))
        found = estimate(cfg, device_bytes, ranks_summed=False)
        worst = max(found.per_rank)
        if worst <= device_bytes:
            return host_problems(cfg, host_bytes)
        said = f"{format_bytes(worst)} per rank" + (f" ({found.detail})" if found.exact else
                                                     " at least (model states alone)")
        return [f"the dry run's estimate is {said}, more than the {format_bytes(device_bytes)} of each GPU; "
                f"{FIXES}; or set {KNOB} to launch anyway"]
    limit = host_memory() if host_bytes is None else host_bytes
    found = estimate(cfg, limit, ranks_summed=True)
    total = sum(found.per_rank) * cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.dp  # the ranks of each pp rank
    if total <= limit:
        return []
    said = f"{format_bytes(total)}" + (f" (the worst, {format_bytes(max(found.per_rank))}, {found.detail})"
                                       if found.exact else " at least (model states alone)")
    return [f"the dry run's estimate for the {world_size} CPU rank(s) on this host is {said}, more than its "
            f"{format_bytes(limit)} of memory; {FIXES}; or set {KNOB} to launch anyway"]
