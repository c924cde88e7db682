"""The rules of ``model.moe`` (docs/moe.md), part of ``validate`` (trainer3d/config/validate.py).

Each problem names the knob and the fix. What the mixture-of-experts blocks do not yet run
under is refused here, before launch, rather than trained wrongly.
"""

from typing import List

from trainer3d.config.schema import Config


def moe_problems(cfg: Config) -> List[str]:
    m, moe, p = cfg.model, cfg.model.moe, cfg.parallel
    if moe.num_experts == 0:
        if p.ep > 1:
            return [f"parallel.ep={p.ep} splits the experts of MoE blocks, and this model has none "
                    "(model.moe.num_experts=0); set parallel.ep=1 or choose an MoE model"]
        return []
    problems = []
    if moe.top_k > moe.num_experts:
        problems.append(f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}; "
                        "lower top_k or add experts")
    if moe.first_dense_layers >= m.n_layers:
        problems.append(f"model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE block in "
                        f"model.n_layers={m.n_layers}; lower it, or set model.moe.num_experts=0 for a dense model")
    # model.init_from: the experts come from a MixtralForCausalLM directory, whose config.json sets
    # model.moe (trainer3d/hf/check.py apply_init_from; a Llama's sets num_experts=0).
    problems += expert_parallel_problems(cfg)
    unsupported = [(p.pp > 1 and p.pp_schedule in ("zb1p", "zbv", "dualpipev"),
                    f"parallel.pp_schedule={p.pp_schedule}", "parallel.pp_schedule=1f1b or interleaved_1f1b"),
                   (p.zero_stage >= 2, f"parallel.zero_stage={p.zero_stage}", "parallel.zero_stage=0 or 1")]
    for refused, knob, fix in unsupported:
        if refused:
            problems.append(f"model.moe (num_experts={moe.num_experts}) does not run with {knob} yet "
                            f"(docs/moe.md); set {fix}")
    return problems


def expert_parallel_problems(cfg: Config) -> List[str]:
    """``parallel.ep`` > 1 (parallel/expert/): ep ranks out of dp x cp, each holding an equal
    share of the experts, under the optimizers that keep expert parameters over their own group."""
    moe, p = cfg.model.moe, cfg.parallel
    if p.ep == 1:
        return []
    if p.ep < 1:
        return [f"parallel.ep={p.ep} must be >= 1; set parallel.ep=1 for no expert parallelism"]
    problems = []
    dp_cp = p.dp * p.cp
    if dp_cp % p.ep:
        fits = [d for d in range(1, dp_cp + 1) if dp_cp % d == 0 and moe.num_experts % d == 0]
        problems.append(f"parallel.ep={p.ep} does not divide parallel.dp x parallel.cp = {p.dp} x {p.cp} = {dp_cp} "
                        f"(ep ranks are carved out of the data-parallel group); set parallel.ep to one of {fits} "
                        "or raise parallel.dp")
    if moe.num_experts % p.ep:
        problems.append(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={p.ep} "
                        "(each ep rank holds an equal share of the experts); choose an ep that divides it")
    # ZeRO 0/1 with AdamW, on the device or offloaded (parallel/expert/optimizer.py), keep the
    # expert parameters over their own expert-dp group; FSDP2 and Muon's sharding do not, and
    # fp16's one loss scale is not shared by its two halves.
    refused = [(p.zero_stage >= 2, f"parallel.zero_stage={p.zero_stage}", "parallel.zero_stage=0 or 1"),
               (cfg.optim.name == "muon", "optim.name=muon", "optim.name=adamw"),
               (cfg.train.dtype == "fp16", "train.dtype=fp16", "train.dtype=bf16 or fp32")]
    for bad, knob, fix in refused:
        if bad:
            problems.append(f"parallel.ep={p.ep} does not run with {knob} (expert parameters keep their own "
                            f"expert-dp group, which only ZeRO 0/1 with AdamW in bf16 or fp32 follows, offloaded "
                            f"or not: docs/moe.md); set {fix} or parallel.ep=1")
    return problems
