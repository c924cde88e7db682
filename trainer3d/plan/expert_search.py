"""Expert parallelism in the planner's search (search.py).

Every MoE layout is tried at each ep degree that divides both dp x cp and the experts
(an ep group is ep neighbouring members of the dp x cp group: trainer3d/parallel/topology.py).
The engine's own ``validate()`` decides, as for every other knob (trainer3d/config/validate_moe.py).
"""

from typing import List


def expert_parallel_sizes(experts: int, group: int) -> List[int]:
    """The ep degrees tried for a layout whose dp x cp group has ``group`` ranks: 1, and for an
    MoE model (``experts`` = ``model.moe.num_experts`` > 0) every divisor of the group that
    divides the experts."""
    if experts == 0:
        return [1]
    return [e for e in range(1, group + 1) if group % e == 0 and experts % e == 0]
