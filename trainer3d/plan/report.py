"""The planner's output: what was searched, the fastest layouts that fit, their commands."""

from typing import Dict, List, Sequence

from trainer3d.memory.states import format_bytes
from trainer3d.model.flops import flops_per_token
from trainer3d.model.transformer import count_parameters
from trainer3d.plan.settings import PlanConfig
from trainer3d.plan.devices import Device
from trainer3d.plan.evaluate import memory_lines, step_lines
from trainer3d.plan.search import Plan, SearchResult, command


def _layout(plan_cfg) -> str:
    p, t = plan_cfg.parallel, plan_cfg.train
    return (f"tp={p.tp}{f' cp={p.cp}' if p.cp > 1 else ''} pp={p.pp} dp={p.dp}{f' ep={p.ep}' if p.ep > 1 else ''} micro={t.micro_batch_size} "
            f"zero={p.zero_stage}" + (f" dp_shard={p.dp_shard}" if p.dp_shard is not None else "") + (" offload" if p.offload_optimizer else "")
            + (" sp" if p.sequence_parallel else "") + (" recompute" if t.activation_checkpointing else "")
            + (f" interleaved v={p.pp_virtual_stages}" if p.pp_virtual_stages > 1 and p.pp_schedule == "interleaved_1f1b"
               else f" {p.pp_schedule} v={p.pp_virtual_stages}" if p.pp > 1 and p.pp_schedule != "1f1b" else ""))


def _zero(p) -> str:
    """The table's zero cell: the stage, ``/S`` when HSDP shards over dp_shard = S, ``+o`` offloaded."""
    return f"{p.zero_stage}{f'/{p.dp_shard}' if p.dp_shard is not None else ''}{'+o' if p.offload_optimizer else ''}"


def summary_lines(cfg: PlanConfig, device: Device, result: SearchResult) -> List[str]:
    c, t = cfg.cluster, cfg.train
    world = c.nodes * c.gpus_per_node
    refused = sum(result.refused.values())
    reasons = ", ".join(f"{knob}: {n:,}" for knob, n in result.refused.most_common())
    lines = [f"model {cfg.model.name}: {count_parameters(cfg.model):,} parameters; {c.nodes} node(s) x "
             f"{c.gpus_per_node} {device.name} = {world} ranks; global batch {t.global_batch_size} x {t.seq_len} "
             f"tokens, {t.dtype}",
             f"device: {device.source}; {format_bytes(device.usable_bytes(c.gpus_per_node))} usable per rank",
             f"searched {result.evaluated:,} layouts: {refused:,} refused by validate()"
             + (f" ({reasons})" if reasons else "") + f", {result.over_memory:,} over memory, "
             f"{len(result.plans):,} fit"]
    if result.closest_over is not None:
        over, closest, rank = result.closest_over
        lines.append(f"  closest that does not fit: {_layout(closest)}, over by {format_bytes(over)} on stage {rank}")
    if result.refusal_examples:  # validate()'s words about a layout the search made, not the user's config
        lines.append(f"  {refused:,} candidate layout(s) the search made itself are not valid layouts "
                     "(nothing to fix in your config); one example per knob:")
        lines += [f"    candidate refused on {knob} ({result.refused[knob]:,}): {example}"
                  for knob, example in result.refusal_examples.items()]
    return lines


def table_lines(cfg: PlanConfig, plans: Sequence[Plan]) -> List[str]:
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    moe = cfg.model.moe.num_experts > 0  # an ep column for mixture-of-experts models
    head = (f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'v':>2} {'dp':>5}" + ("  ep" if moe else "") + f" {'micro':>5} {'accum':>5} {'zero':>4} {'sp':>3} "
            f"{'recomp':>6} {'peak':>10} {'step s':>8} {'bubble':>6} {'tokens/s':>11} {'TFLOP/s/rank':>12}")
    lines = [head]
    for i, plan in enumerate(plans, 1):
        p, t = plan.cfg.parallel, plan.cfg.train
        tflops = flops_per_token(plan.cfg.model, t.seq_len) * plan.tokens_per_s / world / 1e12
        lines.append(f"{i:>3} {p.tp:>3} {p.cp:>3} {p.pp:>3} {p.pp_virtual_stages:>2} {p.dp:>5}"
                     + (f" {p.ep:>3}" if moe else "") + f" {t.micro_batch_size:>5} "
                     f"{t.grad_accum_steps:>5} {_zero(p):>4} {'y' if p.sequence_parallel else '-':>3} "
                     f"{'y' if t.activation_checkpointing else '-':>6} {format_bytes(plan.memory.total):>10} "
                     f"{plan.step.total:>8.3f} {plan.step.bubble / plan.step.total:>6.1%} "
                     f"{plan.tokens_per_s:>11,.0f} {tflops:>12.3g}")
    return lines


def schedule_lines(plans: Sequence[Plan]) -> List[str]:
    """With a pipeline schedule other than 1F1B searched: the fastest fitting layout of each
    schedule (pipelined layouts only), fastest first, and how far each is behind the winner."""
    best: Dict[str, Plan] = {}
    for plan in plans:  # fastest first
        p = plan.cfg.parallel
        if p.pp > 1:
            best.setdefault(p.pp_schedule, plan)
    if len(best) < 2:
        return []
    ranked = sorted(best.values(), key=lambda plan: -plan.tokens_per_s)
    lines = ["fastest pipelined layout of each schedule:",
             f"  {'schedule':<17} {'tokens/s':>11} {'vs best':>8} {'bubble':>6} {'peak':>10}  layout"]
    for plan in ranked:
        lines.append(f"  {plan.cfg.parallel.pp_schedule:<17} {plan.tokens_per_s:>11,.0f} "
                     f"{plan.tokens_per_s / ranked[0].tokens_per_s - 1:>+8.1%} {plan.step.bubble / plan.step.total:>6.1%} "
                     f"{format_bytes(plan.memory.total):>10}  {_layout(plan.cfg)}")
    return lines


def report(cfg: PlanConfig, device: Device, result: SearchResult, user_overrides: Sequence[str]) -> str:
    top = result.plans[:cfg.search.top]
    lines = summary_lines(cfg, device, result)
    if not top:
        lines.append("no layout fits: use more nodes, a smaller train.seq_len, or another cluster.gpu")
        return "\n".join(lines)
    lines += ["", *table_lines(cfg, top), ""]
    by_schedule = schedule_lines(result.plans)
    if by_schedule:
        lines += [*by_schedule, ""]
    lines += [f"{i:>3}  {command(plan.cfg, user_overrides)}" for i, plan in enumerate(top, 1)]
    lines += ["", f"#1 in detail ({_layout(top[0].cfg)}; plan.evaluate=true with its command's overrides prints "
              "the same):", *memory_lines(top[0], device.usable_bytes(cfg.cluster.gpus_per_node)),
              *step_lines(top[0].step)]
    return "\n".join(lines)
