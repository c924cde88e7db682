"""A pipeline schedule's action lists, and the timeline they make with unit costs.

torch's schedules are lists of actions per rank (``pipeline_order``: F, the forward of one
micro-batch on one stage; B, its whole backward; or, for the zero-bubble schedules, I, the
input-gradient half, and W, the weight-gradient half; torch/distributed/pipelining/
schedules.py). ``schedule_actions`` takes them from torch's own schedule classes, so the
planner reasons about the very order a run executes; ``Pipeline`` (schedule.py) records the
order its stages actually ran (``executed``), which tests/multirank/test_pipeline.py
(``test_pipelined_losses_and_grads_equal_one_process``) holds to this one.

``simulate`` runs the lists on an ideal machine: every rank executes its list in order, an
action starts when its rank is free and its inputs exist (F after the previous stage's F of
that micro-batch, I/B after the next stage's I/B, W after its own I), communication is free.
Costs in one unit per layer-chunk: F = 1, I = 1, W = 1, B = I + W = 2 (Qi et al. 2024, "Zero
Bubble Pipeline Parallelism", sec. 2 takes T_F = T_B = T_W as its reference case). A rank with
``v`` stages runs each at 1/v of its layers, so costs are divided by v. The bubble is the idle
share of the step, averaged over ranks: ``1 - busy / makespan``. For 1F1B and GPipe it is
(p - 1) / (m + p - 1), the textbook figure (bubble.py); for the others it is whatever torch's
order leaves, which no closed formula has to match. trainer3d/tools/plot_schedule.py draws the
timelines (docs/parallelism.md shows them).
"""

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Tuple

from trainer3d.parallel.pipeline.placement import stages_of_rank

Action = Tuple[str, int, int]
"""(kind, stage, micro-batch): kind F, B, I or W."""

ZERO_BUBBLE = ("zb1p", "zbv", "dualpipev")
TORCH_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                 "zb1p": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}
"""``parallel.pp_schedule`` -> the torch.distributed.pipelining class that runs it."""
COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


def _fake_stages(schedule: str, pp: int, v: int) -> list:
    """Enough of rank 0's PipelineStages for torch's schedule constructors (which compute every
    rank's list)."""
    return [SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=0, stage_index=s, submod=None)
            for s in stages_of_rank(0, pp, v, schedule)]


def torch_class(schedule: str):
    """torch's class of ``schedule`` (parallel/pipeline/schedule.py builds it)."""
    # Imported here: torch.distributed.pipelining imports torch._dynamo (1-2 s of a process's
    # start), and the planner and every rank's memory estimate import this module.
    import torch.distributed.pipelining as pipelining
    return getattr(pipelining, TORCH_CLASSES[schedule])


@functools.lru_cache(maxsize=64)
def torch_schedule(schedule: str, pp: int, v: int, m: int):
    """torch's multi-stage schedule object for rank 0, built without a process group: its
    ``pipeline_order`` (and ``pipeline_order_with_comms``) hold every rank's actions."""
    return torch_class(schedule)(_fake_stages(schedule, pp, v), m, loss_fn=lambda out, target: out, scale_grads=False)


@functools.lru_cache(maxsize=2)
def torch_order(schedule: str, pp: int, v: int, m: int) -> dict:
    """torch's ``pipeline_order`` (every rank's actions, with its idle slots as None), from the
    schedule class's own functions run on a stand-in holding the attributes they read: the
    class's constructor would also plan every communication, which takes seconds for the
    hundreds of micro-batches the planner tries (its refusals stay ``torch_schedule``'s).

    Read, never changed, by its callers: a layout's bubble (``schedule_actions``) and its
    receive count (receive_count.py), each cached, ask for the same order one after the other
    (trainer3d/plan/search.py ``evaluate``), so the last two orders are kept: a zero-bubble
    order of hundreds of micro-batches is tens of thousands of torch ``_Action``s."""
    cls = torch_class(schedule)
    if schedule not in ZERO_BUBBLE:
        return torch_schedule(schedule, pp, v, m).pipeline_order
    rounds = max(1, m // pp)
    plan = SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=m, num_stages=pp * v,
                           _num_stages=pp * v, number_of_rounds=rounds, microbatches_per_round=m // rounds)
    plan.pipeline_order = {rank: cls._calculate_single_rank_operations(plan, rank) for rank in range(pp)}
    if schedule == "zb1p":
        plan.pipeline_order = cls._add_bubbles_to_actions(plan, pp * v)
    return plan.pipeline_order


@functools.lru_cache(maxsize=256)
def schedule_actions(schedule: str, pp: int, v: int, m: int) -> Dict[int, Tuple[Action, ...]]:
    """Every pp rank's compute actions, in torch 2.13's order, for ``m`` micro-batches."""
    if schedule in ("1f1b", "gpipe"):
        return {r: _single_stage(schedule, pp, m, r) for r in range(pp)}
    out = {}
    for rank, actions in torch_order(schedule, pp, v, m).items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):  # DualPipeV's overlapped F and B run one after the other
                flat.append((str(sub.computation_type.value), sub.stage_index, sub.microbatch_index))
        out[rank] = tuple(flat)
    return out


def _single_stage(schedule: str, pp: int, m: int, rank: int) -> Tuple[Action, ...]:
    """Schedule1F1B's and ScheduleGPipe's order (they keep no action list in torch 2.13): GPipe
    all forwards then all backwards; 1F1B pp - rank warm-up forwards, then one B one F, then B."""
    if schedule == "gpipe":
        return tuple([("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)])
    warm = min(m, pp - rank)
    order = [("F", rank, i) for i in range(warm)]
    for i in range(m):
        order.append(("B", rank, i))
        if warm + i < m:
            order.append(("F", rank, warm + i))
    return tuple(order)


@dataclass
class Timeline:
    spans: Dict[int, List[Tuple[float, float, Action]]]
    """Per rank, (start, end, action) in its execution order."""
    makespan: float

    def bubble(self) -> float:
        """Idle share of the step, averaged over the ranks."""
        idle = [1.0 - sum(e - s for s, e, _ in spans) / self.makespan for spans in self.spans.values()]
        return sum(idle) / len(idle)


def simulate(actions: Dict[int, Tuple[Action, ...]], v: int) -> Timeline:
    """Run the per-rank lists with unit costs divided by ``v`` (see the module docstring)."""
    done: Dict[Action, float] = {}
    last = v * len(actions) - 1
    cost = {kind: c / v for kind, c in COST.items()}
    pos = {r: 0 for r in actions}
    free = {r: 0.0 for r in actions}
    spans: Dict[int, List[Tuple[float, float, Action]]] = {r: [] for r in actions}
    while any(pos[r] < len(actions[r]) for r in actions):
        progressed = False
        for r, todo in actions.items():
            at, start = pos[r], free[r]
            while at < len(todo):
                action = todo[at]
                kind, stage, mb = action
                ready = _ready(done, kind, stage, mb, last)
                if ready is None:
                    break
                for t in ready:
                    start = max(start, t)
                end = start + cost[kind]
                done[action] = end
                spans[r].append((start, end, action))
                start, at = end, at + 1
                progressed = True
            pos[r], free[r] = at, start
        if not progressed:
            stuck = {r: actions[r][pos[r]] for r in actions if pos[r] < len(actions[r])}
            raise ValueError(f"schedule deadlocks at {stuck}")
    return Timeline(spans, max(free.values()))


def _ready(done: Dict[Action, float], kind: str, stage: int, mb: int, last: int):
    """The end times of an action's inputs, or None while one has not run: F after the previous
    stage's F of that micro-batch, I or B after its own F and the next stage's I (else its B),
    W after its own I."""
    if kind == "F":
        if stage == 0:
            return ()
        t = done.get(("F", stage - 1, mb))
        return None if t is None else (t,)
    if kind == "W":
        t = done.get(("I", stage, mb))
        return None if t is None else (t,)
    f = done.get(("F", stage, mb))
    if f is None:
        return None
    if stage == last:
        return (f,)
    t = done.get(("I", stage + 1, mb))
    if t is None:
        t = done.get(("B", stage + 1, mb))
    return None if t is None else (f, t)


STEADY_FROM = 3
"""``steady_micro_batches``'s threshold, in micro-batches per pp rank."""


def steady_micro_batches(schedule: str, pp: int, m: int) -> int:
    """The micro-batch count whose step holds a pp rank's peaks as ``m``'s does: the most receive
    buffers (receive_count.py), the micro-batches in flight on each chunk at each count they pass
    through (trainer3d/memory/in_flight.py ``_states``), and the same idle time per rank
    (``schedule_bubble``). Past the warm-up, every multi-chunk schedule repeats one pattern per
    round of micro-batches (``microbatches_per_round`` = pp once the rounds are m // pp of pp
    each: zb1p and interleaved_1f1b take m % pp == 0 there; zbv and dualpipev any m), so those
    figures stop changing with m once the warm-up and cool-down no longer depend on it: from 2 pp
    micro-batches, for every schedule and 1-4 chunks a rank (tests/unit/test_stages.py
    ``test_the_steady_count_holds_the_figures_of_every_larger_one`` holds pp 2-4 to it, every m to 5 pp;
    pp 8, 16 and 32 at up to 1,024 micro-batches were compared once, when this was written).
    ``STEADY_FROM`` pp is used, a margin over that. Any other m: ``m``. The search
    (trainer3d/plan/search.py) asks for up to a thousand micro-batches, each count simulated in
    torch's order once (tens of thousands of actions per rank)."""
    if pp == 1 or schedule not in ZERO_BUBBLE + ("interleaved_1f1b",):
        return m
    start = STEADY_FROM * pp
    period = 1 if schedule in ("zbv", "dualpipev") else pp
    return start if m > start and m % period == 0 else m


@functools.lru_cache(maxsize=64)
def _steady_timeline(schedule: str, pp: int, v: int, m: int) -> Tuple[float, Tuple[float, ...]]:
    """(makespan, each rank's busy time) of ``simulate`` on ``m`` micro-batches."""
    line = simulate(schedule_actions(schedule, pp, v, m), v)
    return line.makespan, tuple(sum(e - s for s, e, _ in spans) for spans in line.spans.values())


@functools.lru_cache(maxsize=1024)
def schedule_bubble(schedule: str, pp: int, v: int, m: int) -> float:
    """The idle share of an ideal step of torch's ``schedule`` (the planner's and the tests' figure),
    cached: the search (trainer3d/plan/search.py) asks it for every micro-batch size, ZeRO stage,
    recomputation and ep of each (schedule, pp, v, m).

    Past ``steady_micro_batches`` each more micro-batch adds its F, I and W (or F and B: 3 units,
    1/v each on each of the rank's v stages) to every rank's busy time and to the makespan, so
    the steady count's timeline gives m's; with v a power of two every time in it is a multiple
    of 1/v, added exactly, so the figure is the one ``Timeline.bubble`` computes from m's own
    simulation, bit for bit (tests/unit/test_stages.py holds them equal); other v simulate m."""
    if pp == 1:
        return 0.0
    steady = steady_micro_batches(schedule, pp, m)
    if steady == m or v & (v - 1) or schedule not in ZERO_BUBBLE:  # interleaved_1f1b's: not held by the test
        return simulate(schedule_actions(schedule, pp, v, m), v).bubble()
    makespan, busy = _steady_timeline(schedule, pp, v, steady)
    extra = 3 * (m - steady)
    makespan += extra
    idle = [1.0 - (b + extra) / makespan for b in busy]
    return sum(idle) / len(idle)

