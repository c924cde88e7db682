"""Search a cluster's layouts: enumerate, keep what ``validate()`` accepts and what fits,
rank the rest by predicted tokens/s.

The space: tp over the divisors of the ranks per node (tensor parallelism stays inside a
node, trainer3d/parallel/topology.py), for long sequences (``search.context_parallel_from``)
cp over the powers of two that divide what is left, pp over the divisors of what is left
then (at most one layer per stage), dp the rest; then micro-batch size, ZeRO stage, sequence parallelism (tp > 1),
recomputation, expert parallelism for MoE models (plan/expert_search.py) and the schedule (1F1B, or
interleaved 1F1B with v chunks per rank when pp > 1, and the zero-bubble schedules named in
``search.schedules``), and for ZeRO-2/3 hybrid sharding over the dp_shard groups that fit a node
(``dp_shards``). Two of validate()'s rules shape the space instead of filtering it (ZeRO 2/3 only
without a pipeline; at least one layer per stage), a layout over the device's memory is
tried once more with its optimizer offloaded to the host (``search.offload``; ZeRO-2/3: FSDP2's
shards too; with one rank per tp slice, ZeRO-3 offloaded as well), and without data parallelism only ZeRO
stage 0 is tried (the others shard over dp = 1: the same layout). Every candidate goes through the engine's own ``validate()`` (its refusals are
counted by the knob they name), then through the peak-memory accounting of the ranks that
bound it (trainer3d/memory/peak.py), then through the step-time model (step_time.py).
"""

import copy
import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from trainer3d.config.schema import Config, LauncherConfig
from trainer3d.memory.peak import RankMemory, rank_memory
from trainer3d.memory.rank_layout import model_key
from trainer3d.plan.expert_search import expert_parallel_sizes
from trainer3d.plan.settings import PlanConfig
from trainer3d.plan.devices import Device
from trainer3d.plan.offload_cost import HostLink
from trainer3d.plan.block_time import BlockTime
from trainer3d.plan.micro_batch_time import BlockKey
from trainer3d.plan.step_time import StepTime, ranks_evaluated, step_time, tokens_per_s
from trainer3d.config.validate import ConfigError, validate_owned

GiB = 2 ** 30


@dataclass
class Plan:
    """A layout that fits, with its worst rank's peak and its predicted step."""

    cfg: Config
    memory: RankMemory
    step: StepTime
    ranks: Dict[int, RankMemory] = field(default_factory=dict)
    """The peak of every pipeline rank that bounds the layout (``ranks_evaluated``)."""

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.cfg, self.step)

    def host_per_node(self, ranks_per_node: int) -> int:
        """Offloaded optimizer state on one node: the bounding ranks' most, times the ranks per
        node (an upper bound: the pipeline ranks sharing a node hold about the same)."""
        return max((mem.host for mem in self.ranks.values()), default=0) * ranks_per_node


@dataclass
class SearchResult:
    plans: List[Plan] = field(default_factory=list)
    """Every layout that fits, fastest first."""
    evaluated: int = 0
    """Candidates handed to validate()."""
    refused: Counter = field(default_factory=Counter)
    """validate()'s refusals by the knob the first problem names."""
    refusal_examples: Dict[str, str] = field(default_factory=dict)
    over_memory: int = 0
    closest_over: Optional[Tuple[float, Config, int]] = None
    """(bytes over, layout, pipeline rank) of the layout that misses by the least."""


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _launcher(cfg: PlanConfig, device: Device) -> LauncherConfig:
    c = cfg.cluster
    if c.nodes == 1 and device.shared_memory:
        return dataclasses.replace(cfg.launcher, name="local", nodes=1, tasks_per_node=None)
    return dataclasses.replace(cfg.launcher, name="slurm", nodes=c.nodes, tasks_per_node=c.gpus_per_node,
                               gpus_per_node=0 if device.shared_memory else c.gpus_per_node)


def context_parallel_sizes(cfg: PlanConfig, ranks: int) -> List[int]:
    """The cp degrees tried with ``ranks`` left after tp: 1, and for sequences of at least
    ``search.context_parallel_from`` tokens the powers of two up to ``context_parallel_max``
    that divide ``ranks`` and split the sequence into 2 cp equal chunks."""
    s, seq = cfg.search, cfg.train.seq_len
    if seq < s.context_parallel_from:
        return [1]
    sizes, cp = [], 1
    while cp <= min(ranks, s.context_parallel_max):
        if ranks % cp == 0 and seq % (2 * cp) == 0:
            sizes.append(cp)
        cp *= 2
    return sizes


def candidates(cfg: PlanConfig, device: Device) -> Iterator[Config]:
    """Every layout of the search space, unvalidated (see the module docstring). Each has a
    ``parallel`` and a ``train`` of its own; the other groups are one copy of the user's that
    all candidates share (``validate_owned`` writes none of them but a path's ``~``)."""
    c, s, m = cfg.cluster, cfg.search, cfg.model
    world = c.nodes * c.gpus_per_node
    launcher = _launcher(cfg, device)
    base = copy.deepcopy(Config(model=cfg.model, optim=cfg.optim, data=cfg.data, logger=cfg.logger,
                                checkpoint=cfg.checkpoint, launcher=launcher, run_dir="."))
    splits = [(t, k) for t in _divisors(c.gpus_per_node) for k in context_parallel_sizes(cfg, world // t)]
    for tp, cp in splits:
        for pp in (d for d in _divisors(world // (tp * cp)) if d <= m.n_layers):
            schedules = pipeline_schedules(s.schedules, s.virtual_stages, pp, m.n_layers)
            for micro in s.micro_batch_sizes:
                for zero in (z for z in s.zero_stages if (pp == 1 or z < 2) and (world > tp * pp or z == 0)):
                    for sp in (s.sequence_parallel if tp > 1 else [False]):
                        for recompute in s.recompute:
                            dp = world // (tp * cp * pp)
                            for (schedule, v), shard, ep in ((sv, s, e) for sv in schedules
                                                             for s in dp_shards(dp, tp * cp, zero, c.gpus_per_node)
                                                             for e in expert_parallel_sizes(m.moe.num_experts, dp * cp)):
                                parallel = dataclasses.replace(
                                    cfg.parallel, tp=tp, cp=cp, pp=pp, dp=dp, zero_stage=zero, ep=ep,
                                    dp_shard=shard, sequence_parallel=sp, pp_schedule=schedule, pp_virtual_stages=v,
                                    pp_layers=None)
                                train = dataclasses.replace(cfg.train, micro_batch_size=micro, grad_accum_steps=None,
                                                            activation_checkpointing=recompute)
                                yield dataclasses.replace(base, parallel=parallel, train=train)


def pipeline_schedules(names: Sequence[str], virtual: Sequence[int], pp: int, n_layers: int) -> List[Tuple[str, int]]:
    """(schedule, stages per rank) pairs tried: 1F1B as the one-stage case; with a pipeline,
    interleaved_1f1b and zb1p at each v > 1 of ``virtual`` (zb1p at v = 1 too), zbv and
    dualpipev at v = 2, within one layer per stage."""
    out = [("1f1b", 1)]
    if pp == 1:
        return out
    for name in names:
        if name in ("zbv", "dualpipev"):
            vs = [2]
        elif name == "zb1p":
            vs = list(virtual)
        elif name == "interleaved_1f1b":
            vs = [v for v in virtual if v > 1]
        else:
            vs = []
        out += [(name, v) for v in vs if pp * v <= n_layers and (name, v) not in out]
    return out


def dp_shards(dp: int, tp_cp: int, zero: int, ranks_per_node: int) -> List[Optional[int]]:
    """``parallel.dp_shard`` values tried: full sharding (None), and for ZeRO-2/3 whose dp group
    crosses nodes the HSDP shard groups of S < dp that fill a node or a part of one evenly
    (S x tp x cp divides the node's ranks), whose all-gathers and reduce-scatters then stay on
    the node's links."""
    if zero < 2 or dp * tp_cp <= ranks_per_node:
        return [None]
    return [None] + [s for s in _divisors(dp) if s < dp and ranks_per_node % (s * tp_cp) == 0]


_KNOB = re.compile(r"([a-z_]+\.[a-z_]+)")


def evaluate(cfg: Config, device: Device, ranks_per_node: int, backend: str, attention: str = "flash",
             link: Optional[HostLink] = None, model: Optional[str] = None,
             blocks: Optional[Dict[BlockKey, BlockTime]] = None) -> Plan:
    """A validated layout's worst peak memory and predicted step (the step is timed even
    when the memory does not fit; search() drops those); ``model``: ``model_key(cfg)`` where
    the caller has it; ``blocks``: the block times on ``device`` of the layouts evaluated
    before (step_time.py)."""
    model = model if model is not None else model_key(cfg)
    mems = {r: rank_memory(cfg, r, attention, model=model) for r in ranks_evaluated(cfg.parallel.pp)}
    step = step_time(cfg, device, {r: mem.states for r, mem in mems.items()}, ranks_per_node, backend, attention,
                     link, model, blocks)
    return Plan(cfg=cfg, memory=max(mems.values(), key=lambda mem: mem.total), step=step, ranks=mems)


def backend_of(cfg: PlanConfig, device: Device) -> str:
    return cfg.cluster.backend if cfg.cluster.backend != "auto" else ("gloo" if device.shared_memory else "nccl")


def host_link(cfg: PlanConfig) -> HostLink:
    return HostLink(pcie_gbps=cfg.cluster.pcie_gb_s, host_gbps=cfg.cluster.host_memory_gb_s)


def host_usable_bytes(cfg: PlanConfig) -> float:
    """Host memory per node for offloaded optimizer state (``cluster.host_memory_gb`` less 10%)."""
    return 0.9 * cfg.cluster.host_memory_gb * GiB


def _offloaded(cfg: Config) -> Config:
    """``cfg`` offloaded, with a ``train`` of its own for ``validate_owned`` to complete."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, offload_optimizer=True),
                               train=dataclasses.replace(cfg.train))


def _offload_tries(cfg: Config) -> List[Config]:
    """The offloaded layouts to try for a validated layout over the device's memory: its own
    with the optimizer offloaded, and without data parallelism or a pipeline (where ZeRO-3
    alone would shard over one rank: ``candidates`` tries stage 0 only) ZeRO-3 offloaded too,
    which keeps only the units in flight on the device (parallel/zero/fsdp_offload.py)."""
    p = cfg.parallel
    tries = [_offloaded(cfg)]
    if p.dp * p.cp == 1 and p.pp == 1 and p.zero_stage == 0:
        tries.append(_offloaded(dataclasses.replace(cfg, parallel=dataclasses.replace(p, zero_stage=3))))
    return tries


def search(cfg: PlanConfig, device: Device) -> SearchResult:
    """Every candidate that fits, fastest first; a candidate over the device's memory is tried
    again with its optimizer offloaded (``search.offload``), and kept if that fits the device
    and the node's host memory."""
    c = cfg.cluster
    backend = backend_of(cfg, device)
    usable = device.usable_bytes(c.gpus_per_node)
    link, host_usable = host_link(cfg), host_usable_bytes(cfg)
    result = SearchResult()
    model = None  # model_key of the one model all candidates share, once validate_owned has expanded its paths
    blocks: Dict[BlockKey, BlockTime] = {}  # block times on this device, shared by the layouts
    for candidate in candidates(cfg, device):
        result.evaluated += 1
        try:
            valid = validate_owned(candidate)
        except ConfigError as err:
            knob = (_KNOB.search(err.problems[0]) or _KNOB.search("layout.other")).group(1)
            result.refused[knob] += 1
            result.refusal_examples.setdefault(knob, err.problems[0])
            continue
        model = model if model is not None else model_key(valid)
        plan = evaluate(valid, device, c.gpus_per_node, backend, c.attention, link, model, blocks)
        # a CPU node's ranks share one memory: moving state to the host frees nothing there
        if (plan.memory.total > usable and cfg.search.offload and not valid.parallel.offload_optimizer
                and not device.shared_memory):
            for tried in _offload_tries(valid):
                try:  # optim=muon refuses offload (trainer3d/config/validate_optim.py)
                    tried = validate_owned(tried)
                except ConfigError:
                    continue
                offloaded = evaluate(tried, device, c.gpus_per_node, backend, c.attention, link, model, blocks)
                if offloaded.memory.total <= usable and offloaded.host_per_node(c.gpus_per_node) <= host_usable:
                    plan = offloaded
                    break
        if plan.memory.total > usable or plan.host_per_node(c.gpus_per_node) > host_usable:
            result.over_memory += 1
            over = plan.memory.total - usable
            if result.closest_over is None or over < result.closest_over[0]:
                result.closest_over = (over, valid, plan.memory.pp_rank)
            continue
        result.plans.append(plan)
    result.plans.sort(key=lambda plan: (-plan.tokens_per_s, plan.memory.total))
    return result


# ------------------------------------------------------------------ the command to run

_SEARCHED = ("parallel.", "train.micro_batch_size", "train.grad_accum_steps", "train.global_batch_size",
             "train.seq_len", "train.dtype", "train.activation_checkpointing", "launcher", "cluster.", "search.",
             "hydra.")


def layout_overrides(cfg: Config) -> List[str]:
    """The knobs a plan sets, as ``python -m trainer3d.train`` overrides."""
    p, t, launcher = cfg.parallel, cfg.train, cfg.launcher
    out = [f"parallel.tp={p.tp}", f"parallel.pp={p.pp}", f"parallel.dp={p.dp}", f"parallel.zero_stage={p.zero_stage}"]
    if p.cp > 1:
        out.append(f"parallel.cp={p.cp}")
    if p.ep > 1:
        out.append(f"parallel.ep={p.ep}")
    if p.dp_shard is not None:
        out.append(f"parallel.dp_shard={p.dp_shard}")
    if p.sequence_parallel:
        out.append("parallel.sequence_parallel=true")
    if p.offload_optimizer:
        out.append("parallel.offload_optimizer=true")
    if p.pp_schedule != "1f1b":
        out += [f"parallel.pp_schedule={p.pp_schedule}", f"parallel.pp_virtual_stages={p.pp_virtual_stages}"]
    out += [f"train.micro_batch_size={t.micro_batch_size}", "train.grad_accum_steps=null",
            f"train.global_batch_size={t.global_batch_size}", f"train.seq_len={t.seq_len}", f"train.dtype={t.dtype}"]
    if t.activation_checkpointing:
        out.append("train.activation_checkpointing=true")
    if launcher.name == "slurm":
        out += ["launcher=slurm", f"launcher.nodes={launcher.nodes}", f"launcher.tasks_per_node={launcher.tasks_per_node}"]
        if launcher.gpus_per_node:
            out.append(f"launcher.gpus_per_node={launcher.gpus_per_node}")
    return out


def command(cfg: Config, user_overrides: Sequence[str] = ()) -> str:
    """The training command of a plan: the user's own overrides (model, data, optimizer ...)
    that the plan does not set, then the plan's."""
    kept = [o for o in user_overrides if not o.lstrip("+~").startswith(_SEARCHED)]
    return " ".join(["python -m trainer3d.train", *kept, *layout_overrides(cfg)])

