"""Dry run (``dry_run=true``): the layout of a validated config, printed without starting a process.

It shows which global rank is which (pp, dp, tp), the groups, the layers of each pipeline
stage, each stage's model-state memory per rank next to the ZeRO paper's, and each stage's
whole peak term by term — model states, saved activations at the schedule's peak, pipeline
buffers, the largest backward transient — with the worst rank named
(``trainer3d.memory.peak``: the accounting the planner uses too). Shapes come from the
model built on the meta device (no memory) and cut by the same stage split and
tensor-parallel layers the ranks use, so the figures hold for any world size (e.g. 512).
"""

from typing import List, Sequence

import torch

from trainer3d.config.schema import Config
from trainer3d.config.schema_parallel import zero_shards
from trainer3d.memory.activations import Sizes, moe_layer_terms
from trainer3d.memory.moe import layout_model_state_bytes, moe_layers, rank_expert_mask
from trainer3d.model.moe import moe_layer
from trainer3d.parallel.pipeline.stages import stages_of_rank
from trainer3d.memory.states import format_bytes, paper_model_state_bytes, rank_muon_mask, rank_parameter_shapes
from trainer3d.model.transformer import count_parameters
from trainer3d.parallel.pipeline.stages import describe_stages
from trainer3d.memory.peak import RankMemory, rank_memory
from trainer3d.parallel.topology import Topology

MiB, GiB = 2 ** 20, 2 ** 30


def memory_lines(cfg: Config) -> List[str]:
    """Model-state bytes per rank of every pipeline rank (tp rank 0, dp rank 0)."""
    p, t = cfg.parallel, cfg.train
    topo = Topology.of(p)
    bucket = max(1, int(p.bucket_mb * MiB) // 4)
    shards = zero_shards(p)  # ZeRO shards over dp x cp (HSDP: dp_shard x cp)
    lines = [f"model state per rank (parameters + gradients + optimizer; dtype={t.dtype}, "
             f"zero_stage={p.zero_stage}, dp={p.dp}{f' x cp={p.cp}' if p.cp > 1 else ''}"
             f"{f', sharded over dp_shard={p.dp_shard}' if shards < p.dp * p.cp else ''}; "
             "trainer3d/memory/states.py):",
             f"  {'pp rank':>7}  {'parameters':>14}  {'this engine':>12}  {'ZeRO paper*':>12}  "
             f"params / grads / master / optimizer"]
    for pp_rank in range(p.pp):
        rank = topo.rank(pp_rank, 0, 0, 0)
        shapes, experts = rank_parameter_shapes(cfg, rank), rank_expert_mask(cfg, rank)
        psi = sum(torch.Size(s).numel() // (p.ep if x else 1) for s, x in zip(shapes, experts))
        engine = layout_model_state_bytes(shapes, experts, p.ep, shards, p.zero_stage, t.dtype, bucket,
                                          offload=p.offload_optimizer, muon=rank_muon_mask(cfg, rank))
        paper = paper_model_state_bytes(psi, shards, p.zero_stage)
        terms = " / ".join(format_bytes(getattr(engine, k)) for k in ("params", "grads", "master", "optimizer"))
        lines.append(f"  {pp_rank:>7}  {psi:>14,}  {format_bytes(engine.total):>12}  {format_bytes(paper):>12}  {terms}"
                     + (f"  + host {format_bytes(engine.host)}" if engine.host else ""))
    if p.offload_optimizer:
        held = ("fp32 masters, moments and gradient copy" if p.zero_stage < 2
                else "fp32 parameter shard (the masters), gradient shard and moments")
        lines.append(f"  host: the offloaded {held} of each rank (parallel.offload_optimizer), in host memory")
    lines.append("  * the paper's mixed-precision accounting (2+2+12 bytes per parameter); activations not included")
    return lines


def _shown_ranks(pp: int) -> List[int]:
    return list(range(pp)) if pp <= 8 else [0, 1, 2, pp - 3, pp - 2, pp - 1]


def peak_lines(cfg: Config) -> List[str]:
    """Every pipeline rank's peak in a step, term by term (trainer3d/memory/peak.py)."""
    p, t = cfg.parallel, cfg.train
    mems = [rank_memory(cfg, r) for r in range(p.pp)]
    worst = max(mems, key=lambda mem: mem.total)
    shown = [mems[r] for r in _shown_ranks(p.pp)]
    rows = [("model states", lambda mem: mem.states.total)]
    names = dict.fromkeys(k for mem in shown for k in mem.activations)
    rows += [(f"  {k}", lambda mem, k=k: mem.activations.get(k, 0)) for k in names]
    rows += [("activations (saved)", lambda mem: mem.activation_bytes)]
    names = dict.fromkeys(k for mem in shown for k in (*mem.buffers, *mem.transients))
    rows += [(f"{k}", lambda mem, k=k: mem.buffers.get(k, mem.transients.get(k, 0))) for k in names]
    rows += [("step peak (largest transient only)", lambda mem: mem.step_total)]
    if p.zero_stage >= 2:  # trainer3d/memory/startup.py: the shards, then one parameter's fill or the moments
        rows += [("start-up peak (build, ZeRO-2/3)", lambda mem: mem.startup)]
    head = "".join(f"{'pp ' + str(mem.pp_rank):>12}" for mem in shown)
    tokens = f"{t.seq_len} tokens" + (f" (/ cp {p.cp} = {t.seq_len // p.cp} per rank)" if p.cp > 1 else "")
    lines = [f"peak memory per rank in a step (trainer3d/memory/peak.py; micro-batch {t.micro_batch_size} x "
             f"{tokens}, {t.grad_accum_steps} per step, "
             f"recompute={'on' if t.activation_checkpointing else 'off'}):",
             f"  {'term':<34}{head}",
             f"  {'micro-batches in flight':<34}" + "".join(f"{_flight(mem):>12}" for mem in shown)]
    lines += [f"  {label:<34}" + "".join(f"{format_bytes(get(mem)):>12}" for mem in shown) for label, get in rows]
    topo = Topology.of(p)
    first = topo.rank(worst.pp_rank, 0, 0, 0)
    lines.append(f"  worst: pp rank {worst.pp_rank} (global ranks {first}..{first + p.dp * p.cp * p.tp - 1}), "
                 f"{format_bytes(worst.total)} per rank")
    lines += moe_lines(cfg, worst)
    if p.offload_optimizer:
        lines.append(f"  host memory (offloaded optimizer state), most on one rank: {format_bytes(max(m.host for m in mems))}")
    if any(m.staged for m in mems):  # trainer3d/memory/staged.py
        lines.append(f"  host memory (a background checkpoint's copy, checkpoint.async_save), most on one rank: "
                     f"{format_bytes(max(m.staged for m in mems))}, kept from the first save at step "
                     f"{cfg.checkpoint.every}")
    return lines


def moe_lines(cfg: Config, worst: RankMemory) -> List[str]:
    """What the MoE terms charge for the routed tokens (trainer3d/memory/moe.py): exact without
    expert parallelism; with it the balanced expectation, and the dropless worst case beside it."""
    p, moe = cfg.parallel, cfg.model.moe
    if moe.num_experts == 0:
        return []
    blocks = sum(moe_layer(cfg.model, i) for i in range(cfg.model.n_layers))
    line = (f"  MoE: {blocks} of {cfg.model.n_layers} blocks route each token to {moe.top_k} of {moe.num_experts} "
            f"experts{f' ({moe.num_experts // p.ep} per rank, ep={p.ep})' if p.ep > 1 else ''}; ")
    if p.ep == 1:
        return [line + ("tokens x top_k slots per block" if moe.capacity_factor == 0 else
                        "at most num_experts x capacity slots per block (capacity_factor), the bound charged")]
    z = Sizes.of(cfg)
    extra = 0
    for stage in stages_of_rank(worst.pp_rank, p.pp, p.pp_virtual_stages):
        per_block = sum(moe_layer_terms(z, worst=True).values()) - sum(moe_layer_terms(z).values())
        extra += moe_layers(cfg, stage) * per_block * max(worst.in_flight, default=1)
    return [line + "the slots an ep rank receives charged at the balanced expectation (as many as it sends)",
            f"  MoE dropless worst case (every ep rank's tokens to one rank's experts): +{format_bytes(extra)} on "
            f"pp rank {worst.pp_rank}"]


def _flight(mem: RankMemory) -> str:
    return "+".join(map(str, mem.in_flight))


def _group(ranks: List[int]) -> str:
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[-1] + 1, ranks[1] - ranks[0])):
        return f"[{ranks[0]},{ranks[1]},...,{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


def _groups(topo: Topology, dim: str, shown: int = 6) -> str:
    groups = topo.groups(dim)
    text = " ".join(_group(g) for g in groups[:shown])
    return f"{len(groups)} {dim} groups of {len(groups[0])}: {text}" + (" ..." if len(groups) > shown else "")


def describe_plan(cfg: Config, defaults: Sequence[str] = ()) -> str:
    """The dry run's text; ``defaults``: the lines naming the sizing knobs left at their defaults
    (trainer3d/config/defaults_used.py), printed under the batch line."""
    p, t = cfg.parallel, cfg.train
    topo = Topology.of(p)
    cp = f" x cp={p.cp}" if p.cp > 1 else ""
    lines = [
        f"layout: tp={p.tp}{cp} x pp={p.pp} x dp={p.dp} = {topo.world_size} ranks, zero_stage={p.zero_stage}"
        + (", optimizer offloaded to the host" if p.offload_optimizer else "")
        + (", sequence parallel" if p.sequence_parallel else "")
        + (f", context parallel ({p.cp_attention})" if p.cp > 1 else ""),
        f"model: {cfg.model.name}, {count_parameters(cfg.model):,} parameters",
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x grad_accum {t.grad_accum_steps} "
        f"x dp {p.dp} sequences of {t.seq_len} tokens",
        *defaults,
        *(_groups(topo, dim) for dim in ("tp", *(("cp",) if p.cp > 1 else ()), "dp", "pp")),
    ]
    if p.pp > 1:
        lines.append(describe_stages(cfg))
    lines += memory_lines(cfg)
    lines += peak_lines(cfg)
    if p.cp > 1:
        lines += ["rank     pp    dp    cp    tp"] + [f"{r:<7} {c.pp:>3}  {c.dp:>4}  {c.cp:>4}  {c.tp:>4}"
                                                   for r in range(topo.world_size) for c in [topo.coords(r)]]
    else:
        lines += ["rank     pp    dp    tp"] + [f"{r:<7} {c.pp:>3}  {c.dp:>4}  {c.tp:>4}"
                                             for r in range(topo.world_size) for c in [topo.coords(r)]]
    return "\n".join(lines)


def print_plan(cfg: Config, defaults: Sequence[str] = ()) -> None:
    print(describe_plan(cfg, defaults))
