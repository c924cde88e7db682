"""How many micro-batches a pipeline stage holds saved for backward at once, and at which
point of its schedule: the order of its forwards and backwards, walked for the peak.

The bytes of one micro-batch are trainer3d/memory/activations.py's; trainer3d/memory/peak.py
multiplies them by the counts here. 1F1B and GPipe have closed forms (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", sec. 2.2: 1F1B's stage s
holds min(m, pp - s)); interleaved 1F1B is walked in torch's order, the zero-bubble
schedules along torch's own action lists.

Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism") hold a micro-batch
from its forward to its weight step W, not to its input step I. I is torch's
``stage_backward_input`` (torch/distributed/pipelining/_backward.py): ``autograd.grad`` to the
stage input with ``retain_graph=True``, so every node it runs keeps what it saved, and the
stage output is detached after it (the graph is then reached only through the
"intermediates" it keeps for W). W (parallel/pipeline/weight_grad.py) runs from those
intermediates to the weights without ``retain_graph``: the nodes it runs free their saved
tensors as they run, and the nodes it never runs (the attention kernel and RoPE between the
output projection and q, k, v, which lead to no weight of their own) are freed when it drops
the intermediates, the graph's last reference. The first stage has no input gradient: torch
runs its whole backward at W. So W releases the micro-batch and I releases nothing;
tests/multirank/test_activation_memory.py measures zbv, dualpipev and zb1p to the byte.
"""

import functools
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

from trainer3d.config.schema import Config
from trainer3d.parallel.pipeline.placement import stages_of_rank
from trainer3d.parallel.pipeline.timeline import ZERO_BUBBLE, schedule_actions, steady_micro_batches


def schedule_ops(schedule: str, pp: int, virtual: int, m: int, pp_rank: int) -> List[Tuple[str, int]]:
    """The forward ('F') and backward ('B') order of local chunk indices on ``pp_rank``, as
    torch.distributed.pipelining 2.13 runs it (torch/distributed/pipelining/schedules.py):

    - gpipe: every forward, then every backward;
    - 1f1b: min(m, pp - rank) warm-up forwards, then one backward and one forward in turn
      (``Schedule1F1B._step_microbatches``);
    - interleaved_1f1b: (v - 1) * mb_per_round + 2 (pp - 1 - rank) warm-up forwards
      (``_get_warmup_ops``), then one forward and one backward in turn; forwards walk the
      local chunks round by round, backwards in reverse (``forward_stage_index`` /
      ``backward_stage_index`` of ``ScheduleInterleaved1F1B``).
    - zb1p, zbv, dualpipev: torch's own action lists (parallel/pipeline/timeline.py), where
      W counts as 'B' and I as nothing (the module docstring says why).
    Without a pipeline every micro-batch runs forward and backward before the next one.
    """
    if pp == 1:
        return [op for _ in range(m) for op in (("F", 0), ("B", 0))]
    if schedule in ZERO_BUBBLE:
        local = stages_of_rank(pp_rank, pp, virtual, schedule)
        return [("F" if kind == "F" else "B", local.index(stage))
                for kind, stage, _ in schedule_actions(schedule, pp, virtual, m)[pp_rank] if kind in ("F", "B", "W")]
    if schedule == "gpipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1f1b":
        warmup = min(pp - pp_rank, m)
        steady = [op for _ in range(m - warmup) for op in (("B", 0), ("F", 0))]
        return [("F", 0)] * warmup + steady + [("B", 0)] * warmup
    if schedule != "interleaved_1f1b":
        raise ValueError(f"pipeline schedule {schedule!r}")
    per_round = m // max(1, m // pp)
    total = virtual * m
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    fwd = [(k // per_round) % virtual for k in range(total)]
    bwd = [virtual - 1 - ((k - warmup) // per_round) % virtual for k in range(warmup, warmup + total)]
    ops = [("F", c) for c in fwd[:warmup]]
    for k in range(total - warmup):
        ops += [("F", fwd[warmup + k]), ("B", bwd[k])]
    return ops + [("B", c) for c in bwd[total - warmup:]]


def peak_in_flight(ops: Sequence[Tuple[str, int]], per_micro: Sequence[int], per_step: Sequence[int]
                   ) -> Tuple[int, List[int]]:
    """The most bytes alive over ``ops``, and each chunk's micro-batches in flight then.

    ``per_micro[c]``: what one micro-batch leaves on local chunk c until its backward;
    ``per_step[c]``: what chunk c keeps while any of its micro-batches is in flight.
    """
    alive: Dict[int, int] = defaultdict(int)
    live, best, at = 0, 0, [0] * len(per_micro)
    for kind, chunk in ops:
        step = 1 if kind == "F" else -1
        before = alive[chunk]
        alive[chunk] += step
        live += step * per_micro[chunk]
        if (before == 0) != (alive[chunk] == 0):  # the chunk's first micro-batch arrived or its last left
            live += step * per_step[chunk]
        if live > best:
            best, at = live, [alive[c] for c in range(len(per_micro))]
    return best, at


@functools.lru_cache(maxsize=4096)
def _states(schedule: str, pp: int, virtual: int, m: int, pp_rank: int, chunks: int) -> Tuple[Tuple[int, ...], ...]:
    """Each distinct count of micro-batches in flight per local chunk that the rank's ops pass
    through, in the order first reached. The bytes alive at a point of the walk are a function
    of those counts alone (``_alive_bytes``), so the walk's peak is the first of these with the
    most bytes: ``peak_in_flight`` without walking the ops again for every candidate's bytes
    (an interleaved schedule of m micro-batches walks 2 v m ops and passes through a few
    hundred counts at most)."""
    alive, seen = [0] * chunks, {}
    for kind, chunk in schedule_ops(schedule, pp, virtual, m, pp_rank):
        alive[chunk] += 1 if kind == "F" else -1
        seen.setdefault(tuple(alive), None)
    return tuple(seen)


def _alive_bytes(counts: Sequence[int], per_micro: Sequence[int], per_step: Sequence[int]) -> int:
    return sum(n * b + (s if n else 0) for n, b, s in zip(counts, per_micro, per_step))


def in_flight(cfg: Config, pp_rank: int, per_micro: List[int], per_step: List[int]) -> Tuple[int, List[int]]:
    """Peak saved bytes of ``pp_rank`` and its chunks' micro-batches in flight then (closed
    forms where there is one); ``per_micro``/``per_step`` by local chunk as in ``peak_in_flight``
    (the same figures, over ``_states``)."""
    p, m = cfg.parallel, cfg.train.grad_accum_steps
    if p.pp > 1 and p.pp_schedule not in ("1f1b", "gpipe"):
        best, at = 0, [0] * len(per_micro)
        steady = steady_micro_batches(p.pp_schedule, p.pp, m)  # the same counts as m's (timeline.py)
        for counts in _states(p.pp_schedule, p.pp, p.pp_virtual_stages, steady, pp_rank, len(per_micro)):
            live = _alive_bytes(counts, per_micro, per_step)
            if live > best:
                best, at = live, list(counts)
        return best, at
    count = 1 if p.pp == 1 else m if p.pp_schedule == "gpipe" else min(m, p.pp - pp_rank)
    return count * per_micro[0] + per_step[0], [count]
