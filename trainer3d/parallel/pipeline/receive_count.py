"""How many pipeline receive buffers a rank holds at once (buffers.py allocates them per
micro-batch in flight only): the count the memory estimate (trainer3d/memory/peak.py) charges
and tests/multirank/test_pipeline.py holds the measured peak to.
"""

import functools
from typing import Tuple

from trainer3d.parallel.pipeline.placement import rank_of_stage
from trainer3d.parallel.pipeline.timeline import ZERO_BUBBLE, steady_micro_batches, torch_order


def receive_buffers_held(schedule: str, pp: int, virtual: int, m: int, pp_rank: int) -> int:
    """The most receive buffers (one hidden state each) pp rank ``pp_rank`` holds at once.

    1F1B: stage s receives its input for each of its min(m, pp - s) micro-batches in flight,
    plus one output gradient during a backward (none on the last stage); GPipe: all m
    inputs, plus that gradient. Interleaved 1F1B and the zero-bubble schedules: counted along
    torch's own action order, of ``steady_micro_batches`` (timeline.py) micro-batches.
    """
    if pp == 1:
        return 0
    if schedule == "interleaved_1f1b":  # past the warm-up the count no longer grows with m
        return _interleaved_held(pp, virtual, steady_micro_batches(schedule, pp, m))[pp_rank]
    if schedule in ZERO_BUBBLE:
        return _zero_bubble_held(schedule, pp, virtual, steady_micro_batches(schedule, pp, m))[pp_rank]
    in_flight = m if schedule == "gpipe" else min(m, pp - pp_rank)
    return (pp_rank > 0) * in_flight + (pp_rank < pp - 1)


@functools.lru_cache(maxsize=256)
def _interleaved_held(pp: int, virtual: int, m: int) -> Tuple[int, ...]:
    """Per rank, the peak count of receive buffers over ``ScheduleInterleaved1F1B``'s actions
    with the receives torch inserts (``_add_send_recv``, torch 2.13 schedules.py): a buffer
    lives from its RECV_F or RECV_B to its micro-batch's backward on that stage."""
    compute = [interleaved_compute(pp, virtual, m, r) for r in range(pp)]
    return _sweep_receives(compute, pp, pp * virtual)


def interleaved_compute(pp: int, virtual: int, m: int, rank: int) -> list:
    """Rank ``rank``'s compute actions of ``ScheduleInterleaved1F1B`` as (stage, micro-batch,
    is_forward), its idle slots left out: what ``_calculate_single_rank_operations`` returns
    (torch 2.13 schedules.py, through ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``), in plain
    tuples. torch builds an ``_Action`` per step and looks the stage up by closures, which took
    most of the 70B plan of docs/planning.md; tests/unit/test_stages.py
    (``test_the_one_pass_interleaved_receive_count_is_torchs``) holds the count to torch's own
    lists."""
    per_round = m // max(1, m // pp)  # microbatches_per_round
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), m * virtual)
    total = m * virtual  # warm-up forwards, then one forward and one backward each, then the backwards left
    forwards, backwards = [0] * virtual, [0] * virtual  # per local stage: micro-batches handed out
    out = []
    for op in range(total + warmup):
        if op < total:
            local = (op // per_round) % virtual
            out.append((local * pp + rank, forwards[local], True))
            forwards[local] += 1
        if op >= warmup:
            local = virtual - 1 - ((op - warmup) // per_round) % virtual
            out.append((local * pp + rank, backwards[local], False))
            backwards[local] += 1
    return out


def _sweep_receives(compute: list, pp: int, n_stages: int) -> Tuple[int, ...]:
    """``_add_send_recv``'s placement of the receives, counted as it goes: the same sweeps over
    the ranks in order, each rank taking its next compute action once its input has been sent,
    and each send appending its receive to the receiving rank's list at that moment. torch
    keeps every action in sets and pops lists from the front (quadratic: 13.6 of 24 s of the
    70B plan at up to 1,024 micro-batches); this keeps per stage how many forwards and
    backwards have run, which says the same here: a stage runs its micro-batches in order
    (``_get_1f1b_rank_ops``) and neighbouring stages ``s % pp`` always sit on two ranks.

    ``compute[r]`` is rank r's actions as (stage, micro-batch, is_forward), full backwards
    otherwise.
    """
    done = {True: [0] * n_stages, False: [0] * n_stages}  # per stage: forwards run, backwards run
    live, peak, next_of = [0] * pp, [0] * pp, [0] * pp
    last = n_stages - 1

    def receive(stage: int) -> None:
        rank = stage % pp
        live[rank] += 1
        peak[rank] = max(peak[rank], live[rank])

    pending = [r for r in range(pp) if compute[r]]
    while pending:
        progress = False
        for rank in pending:
            stage, mb, forward = compute[rank][next_of[rank]]
            source = stage - 1 if forward else stage + 1
            if 0 <= source <= last and done[forward][source] <= mb:
                continue  # its input has not been sent yet
            done[forward][stage] += 1
            if forward and stage < last:
                receive(stage + 1)
            if not forward:
                live[rank] -= (stage > 0) + (stage < last)
                if stage > 0:
                    receive(stage - 1)
            next_of[rank] += 1
            progress = True
        if not progress:
            raise AssertionError(f"interleaved_1f1b pp={pp}: no rank can take its next action")
        pending = [r for r in pending if next_of[r] < len(compute[r])]
    return tuple(peak)


@functools.lru_cache(maxsize=256)
def _zero_bubble_held(schedule: str, pp: int, virtual: int, m: int) -> Tuple[int, ...]:
    """Per rank, the peak count of receive buffers over torch's action lists with their
    communication (``pipeline_order_with_comms``): a buffer lives from its RECV_F or RECV_B to
    its micro-batch's B or W on that stage (buffers.py keeps both for the weight step). Stages
    next to each other on one rank (the tip of a V) pass tensors without a receive.

    The order is lowered as the runtime lowers it (``_prepare_schedule_with_comms``, torch 2.13
    schedules.py): UNSHARD/RESHARD and REDUCE_GRAD first, then the receives, whose places
    ``_add_send_recv`` finds by simulating every rank's progress one action at a time, so the
    added actions move them (zbv pp4 m8, rank 0: two gradient receives posted ahead at the
    end of the step, three buffers held, not two)."""
    from torch.distributed.pipelining.schedules import _add_reduce_grad

    lowered = {r: _add_reduce_grad(with_unshard_reshard(actions), m)
               for r, actions in torch_order(schedule, pp, virtual, m).items()}
    return _sweep_comms(lowered, lambda stage: rank_of_stage(stage, pp, schedule), pp * virtual)


def _sweep_comms(lowered: dict, rank_of, n_stages: int) -> Tuple[int, ...]:
    """``_add_send_recv``'s sweeps (torch 2.13 schedules.py), counting the buffers as it places
    the receives: each sweep offers every rank, in rank order, its next action, which runs once
    its inputs have been sent; each send appends its receive to the receiving rank's list at
    that moment. torch asks that of a set of the rank's own actions and receives, building an
    ``_Action`` per question, then lists the receives for a second pass to count; an input
    sent is its producing action having run on whichever rank (a receive exists exactly when
    the two stages sit on two ranks), so one set of the actions run answers it here, and the
    count is kept as the receives are placed.
    """
    from torch.distributed.pipelining.schedules import _ComputationType as C

    last = n_stages - 1
    ran = set()  # (computation type, stage, micro-batch) of every action run so far
    live = {r: {} for r in lowered}  # per rank: (stage, micro-batch) -> the kinds of receive held
    count, peak = dict.fromkeys(lowered, 0), dict.fromkeys(lowered, 0)

    def ready(a) -> bool:
        kind, stage, mb = a.computation_type, a.stage_index, a.microbatch_index
        if kind is C.FORWARD and stage != 0:
            return (C.FORWARD, stage - 1, mb) in ran
        if kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD) and stage != last:
            return (C.BACKWARD_INPUT, stage + 1, mb) in ran or (C.FULL_BACKWARD, stage + 1, mb) in ran
        return True

    def receive(kind, stage: int, mb: int) -> None:
        rank = rank_of(stage)
        held = live[rank].setdefault((stage, mb), set())
        if kind not in held:
            held.add(kind)
            count[rank] += 1
            peak[rank] = max(peak[rank], count[rank])

    def run(rank: int, a) -> None:
        kind, stage, mb = a.computation_type, a.stage_index, a.microbatch_index
        ran.add((kind, stage, mb))
        if kind in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
            count[rank] -= len(live[rank].pop((stage, mb), ()))
        if kind is C.FORWARD and stage != last and rank_of(stage + 1) != rank:
            receive(C.RECV_F, stage + 1, mb)
        elif kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD) and stage != 0 and rank_of(stage - 1) != rank:
            receive(C.RECV_B, stage - 1, mb)

    next_of = dict.fromkeys(lowered, 0)
    pending = sorted(r for r in lowered if lowered[r])
    while pending:
        progress = False
        for rank in pending:
            action = lowered[rank][next_of[rank]]
            if action is not None:  # UNSHARD, RESHARD and REDUCE_GRAD take their sweep, always ready
                subs = action.sub_actions if action.sub_actions is not None else (action,)
                if not all(ready(a) for a in subs):
                    continue
                for a in subs:  # DualPipeV's F;B pairs: both checked before either runs
                    run(rank, a)
            next_of[rank] += 1
            progress = True
        if not progress:
            raise AssertionError("zero-bubble schedule: no rank can take its next action")
        pending = [r for r in pending if next_of[r] < len(lowered[r])]
    return tuple(peak[r] for r in sorted(lowered))


def with_unshard_reshard(actions: list, window: int = 3) -> list:
    """What torch's ``_add_unshard_reshard(actions, window)`` returns (torch 2.13,
    torch/distributed/pipelining/schedules.py), in one pass where a rank holds fewer stages
    than ``window``, as every rank of a V schedule does (two).

    Before each compute action torch prefetches the first ``window`` distinct stages of the
    actions from there to the end and evicts the active ones not among them, scanning the rest
    of the list every time: while fewer distinct stages exist than ``window`` the scan never
    stops early, so it reads the whole list per action (zbv pp32 with 512 micro-batches: 16 s
    of a 66 s plan). Those stages in order of first appearance are here gathered once, from
    the end backwards. With ``window`` stages or more on the rank, torch's own is called.
    """
    from torch.distributed.pipelining.schedules import _Action, _add_unshard_reshard, _ComputationType as C

    def stages(a):
        subs = a.sub_actions if a.computation_type == C.OVERLAP_F_B and a.sub_actions is not None else (a,)
        return [sub.stage_index for sub in subs]

    compute = [a for a in actions if a is not None]
    if len({s for a in compute for s in stages(a)}) >= window:
        return _add_unshard_reshard(actions, window)
    ahead, order = [], []
    for a in reversed(compute):  # the distinct stages from each action on, first seen first
        for s in reversed(stages(a)):
            order = [s] + [t for t in order if t != s]
        ahead.append(order)
    active, out = set(), []  # a set as torch's: its eviction order is the set's iteration order
    for a, next_n in zip(compute, reversed(ahead)):
        for s in [s for s in active if s not in next_n]:
            active.remove(s)
            out.append(_Action(s, C.RESHARD, None))
        for s in [s for s in next_n if s not in active]:
            active.add(s)
            out.append(_Action(s, C.UNSHARD, None))
        out.append(a)
    for s in list(active):
        active.remove(s)
        out.append(_Action(s, C.RESHARD, None))
    return out
