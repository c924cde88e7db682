"""``python -m trainer3d.plan plan.evaluate=true ...``: one given layout instead of a search.

The layout is the overrides' own (``parallel.*``, ``train.micro_batch_size``,
``train.activation_checkpointing``, ...) on ``cluster.nodes`` x ``cluster.gpus_per_node``
ranks of ``cluster.gpu``; it goes through the engine's ``validate()``, the peak-memory
accounting of the pipeline ranks that bound it (trainer3d/memory/peak.py) and the step-time
model (step_time.py), exactly as a search's candidate does. The report prints every memory
term of those ranks and every step-time term; its last line is one JSON object:

    tokens_per_s, tokens_per_s_per_gpu, model_tflops_per_gpu (the PaLM count the metrics use,
    trainer3d/model/flops.py), mfu (of the data sheet's dense peak; null where unknown),
    step_s, step_terms (seconds by term, StepTime.terms), peak_bytes (the worst rank),
    usable_bytes, fits, bounding_rank, layout
"""

import json
from typing import Dict, List, Tuple

from trainer3d.config.schema import Config
from trainer3d.config.validate import validate
from trainer3d.memory.states import format_bytes
from trainer3d.model.flops import flops_per_token
from trainer3d.plan.devices import Device
from trainer3d.plan.search import Plan, _launcher, backend_of, evaluate, host_link
from trainer3d.plan.settings import PlanConfig
from trainer3d.plan.step_time import StepTime


class LayoutError(ValueError):
    """The overrides do not describe one layout of the cluster."""


def layout_config(cfg: PlanConfig, device: Device) -> Config:
    """The training config of the overrides' layout on the cluster, validated."""
    c, p, t = cfg.cluster, cfg.parallel, cfg.train
    world = c.nodes * c.gpus_per_node
    model_ranks = p.tp * p.cp * p.pp
    if model_ranks * p.dp != world:
        fix = f"parallel.dp={world // model_ranks}" if world % model_ranks == 0 else "another parallel.tp/cp/pp"
        raise LayoutError(f"parallel.tp*cp*pp*dp = {p.tp}*{p.cp}*{p.pp}*{p.dp} = {model_ranks * p.dp} ranks, but "
                          f"cluster.nodes*cluster.gpus_per_node = {world}; set {fix}")
    if t.micro_batch_size is None and t.grad_accum_steps is None:
        raise LayoutError("plan.evaluate=true evaluates one layout: set train.micro_batch_size "
                          "(conf/plan.yaml leaves it to the search)")
    base = Config(model=cfg.model, optim=cfg.optim, data=cfg.data, logger=cfg.logger, checkpoint=cfg.checkpoint,
                  launcher=_launcher(cfg, device), parallel=p, train=t, run_dir=".")
    return validate(base)


def evaluate_layout(cfg: PlanConfig, device: Device) -> Plan:
    """Memory and step time of the overrides' layout (raises LayoutError or ConfigError)."""
    c = cfg.cluster
    if c.attention not in ("flash", "math"):
        raise LayoutError(f"cluster.attention={c.attention} is not one of flash, math")
    return evaluate(layout_config(cfg, device), device, c.gpus_per_node, backend_of(cfg, device), c.attention,
                    host_link(cfg))


def _terms(terms: Dict[str, int]) -> str:
    return ", ".join(f"{name} {format_bytes(value)}" for name, value in sorted(terms.items(), key=lambda kv: -kv[1])
                     if value) or "none"


def memory_lines(plan: Plan, usable: float) -> List[str]:
    """Every term of the peak of each pipeline rank that bounds the layout."""
    lines = [f"memory per rank (peak; {format_bytes(usable)} usable):"]
    for rank, mem in sorted(plan.ranks.items()):
        s = mem.states
        verdict = "fits" if mem.total <= usable else f"over by {format_bytes(mem.total - usable)}"
        lines += [f"  pipeline rank {rank}: {format_bytes(mem.total)} ({verdict}); micro-batches in flight "
                  f"{mem.in_flight}",
                  f"    model states {format_bytes(s.total)}: parameters {format_bytes(s.params)}, gradients "
                  f"{format_bytes(s.grads)}, master {format_bytes(s.master)}, optimizer {format_bytes(s.optimizer)}"
                  + (f", gathered {format_bytes(s.gathered)}" if s.gathered else ""),
                  f"    activations {format_bytes(mem.activation_bytes)}: {_terms(mem.activations)}",
                  f"    pipeline buffers {format_bytes(mem.buffer_bytes)}: {_terms(mem.buffers)}",
                  f"    largest transient {format_bytes(mem.transient_bytes)} of: {_terms(mem.transients)}"]
    return lines


def step_lines(step: StepTime) -> List[str]:
    """Every term of the predicted step, seconds and share of the step."""
    total = step.total
    lines = [f"step time {total:.4g} s:"]
    for name, value in step.terms().items():
        label = "  " + name.replace("compute.", "  ")
        lines.append(f"{label:<24} {value:>10.4g} s {value / total:>7.1%}" if total else f"{label:<24} {value:.4g} s")
    return lines


def summary(cfg: PlanConfig, device: Device, plan: Plan) -> Dict[str, object]:
    """The JSON line's fields (module docstring)."""
    c, t = cfg.cluster, plan.cfg.train
    world = c.nodes * c.gpus_per_node
    per_gpu = plan.tokens_per_s / world
    tflops = flops_per_token(plan.cfg.model, t.seq_len) * per_gpu / 1e12
    peak = device.peak_tflops.get(t.dtype)
    usable = device.usable_bytes(c.gpus_per_node)
    p = plan.cfg.parallel
    layout = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "zero_stage": p.zero_stage,
              "sequence_parallel": p.sequence_parallel,
              "pp_schedule": p.pp_schedule, "pp_virtual_stages": p.pp_virtual_stages,
              "micro_batch_size": t.micro_batch_size, "grad_accum_steps": t.grad_accum_steps,
              "activation_checkpointing": t.activation_checkpointing}
    return {"tokens_per_s": plan.tokens_per_s, "tokens_per_s_per_gpu": per_gpu, "model_tflops_per_gpu": tflops,
            "mfu": tflops / peak if peak else None, "step_s": plan.step.total, "step_terms": plan.step.terms(),
            "peak_bytes": plan.memory.total,
            "usable_bytes": int(usable), "fits": plan.memory.total <= usable, "bounding_rank": plan.memory.pp_rank,
            "device": device.name, "world": world, "layout": layout}


def evaluate_report(cfg: PlanConfig, device: Device) -> Tuple[str, Dict[str, object]]:
    """The breakdown of the overrides' layout, its last line the JSON summary."""
    plan = evaluate_layout(cfg, device)
    fields = summary(cfg, device, plan)
    c, t = cfg.cluster, plan.cfg.train
    lines = [f"layout {json.dumps(fields['layout'])} on {c.nodes} node(s) x {c.gpus_per_node} {device.name}; "
             f"global batch {t.global_batch_size} x {t.seq_len} tokens, {t.dtype}",
             f"device: {device.source}",
             *memory_lines(plan, fields["usable_bytes"]), *step_lines(plan.step),
             f"{fields['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {fields['model_tflops_per_gpu']:.4g} model "
             "TFLOP/s per GPU" + (f", MFU {fields['mfu']:.1%}" if fields["mfu"] is not None else ""),
             json.dumps(fields)]
    return "\n".join(lines), fields

