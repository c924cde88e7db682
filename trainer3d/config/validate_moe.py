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
    unsupported = [(p.ep > 1, f"parallel.ep={p.ep}", "parallel.ep=1"),
                   (p.zero_stage >= 2, f"parallel.zero_stage={p.zero_stage}", "parallel.zero_stage=0 or 1"),
                   (p.offload_optimizer, "parallel.offload_optimizer=true", "parallel.offload_optimizer=false")]
    for refused, knob, fix in unsupported:
        if refused:
            problems.append(f"model.moe (num_experts={moe.num_experts}) does not run with {knob} yet "
                            f"(docs/moe.md); set {fix}")
    return problems
