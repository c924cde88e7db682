"""Expert parallelism in the planner's search (search.py).

Every MoE layout is tried at each ep degree that divides both dp x cp and the experts
(docs/DESIGN: an ep group is ep neighbouring members of the dp x cp group). The engine's own
``validate()`` decides, as for every other knob: where it accepts ep, an ep layout is a plan
like any other. Until expert parallelism is built, ``validate()`` refuses ep > 1
(trainer3d/config/validate_moe.py); ``pending_ep`` then evaluates the layout that would be
valid once ep is accepted — the same layout validated at ep = 1, plus ep's own rules — so the
planner can say what ep would buy. Those answers are reported apart, marked as needing
``parallel.ep``, never as a command to run.
"""

import dataclasses
from typing import List, Optional

from trainer3d.config.schema import Config
from trainer3d.config.validate import ConfigError, validate


def expert_parallel_sizes(experts: int, group: int) -> List[int]:
    """The ep degrees tried for a layout whose dp x cp group has ``group`` ranks: 1, and for an
    MoE model (``experts`` = ``model.moe.num_experts`` > 0) every divisor of the group that
    divides the experts."""
    if experts == 0:
        return [1]
    return [e for e in range(1, group + 1) if group % e == 0 and experts % e == 0]


def ep_rule_problems(cfg: Config) -> List[str]:
    """Expert parallelism's own rules (issue 39; DESIGN's ``ep`` divides ``dp x cp``): what a
    layout must satisfy for ep to split its experts."""
    p, moe = cfg.parallel, cfg.model.moe
    problems = []
    if (p.dp * p.cp) % p.ep:
        problems.append(f"parallel.ep={p.ep} does not divide dp x cp = {p.dp * p.cp}")
    if moe.num_experts % p.ep:
        problems.append(f"parallel.ep={p.ep} does not divide model.moe.num_experts={moe.num_experts}")
    if p.zero_stage >= 2:
        problems.append(f"parallel.ep={p.ep} with parallel.zero_stage={p.zero_stage}: expert shards are ZeRO-1's")
    return problems


def pending_ep(candidate: Config) -> Optional[Config]:
    """The validated layout with ep > 1 where ``validate()`` refused ``candidate`` only for ep
    (its ep = 1 twin is valid and ep's rules hold), else None."""
    ep = candidate.parallel.ep
    if ep == 1 or candidate.model.moe.num_experts == 0:
        return None
    try:
        valid = validate(dataclasses.replace(candidate, parallel=dataclasses.replace(candidate.parallel, ep=1)))
    except ConfigError:
        return None
    out = dataclasses.replace(valid, parallel=dataclasses.replace(valid.parallel, ep=ep))
    return None if ep_rule_problems(out) else out
