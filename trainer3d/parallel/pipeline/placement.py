"""Which pipeline stages each pp rank runs (stages.py's docstring draws both placements).

Apart from stages.py so that the schedule arithmetic (timeline.py, receive_count.py, bubble.py)
can use it without the model-cutting code.
"""

from typing import List

from trainer3d.config.schema_parallel import V_SCHEDULES


def stages_of_rank(pp_rank: int, pp: int, virtual_stages: int = 1, schedule: str = "1f1b") -> List[int]:
    """The stage indices pp rank ``pp_rank`` runs, in order: r, r + pp, ... (or r, 2 pp - 1 - r in a V)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def holds_embedding(stage: int, n_stages: int, tied: bool, pp: int, schedule: str = "1f1b") -> bool:
    """Whether pipeline ``stage`` holds an embedding matrix of its own: the first stage, and the
    last one too when the head is tied to it, unless a V puts the last stage on the first
    stage's rank, where both share one Parameter (trainer3d/parallel/tied.py)."""
    last = n_stages - 1
    return stage == 0 or (stage == last and tied and rank_of_stage(last, pp, schedule) != 0)


def rank_of_stage(stage: int, pp: int, schedule: str = "1f1b") -> int:
    """The pp rank that runs ``stage`` (the inverse of ``stages_of_rank``)."""
    if schedule in V_SCHEDULES and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp
