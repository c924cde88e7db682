"""The pipeline stage split and the schedule rules: pure functions, no processes."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from trainer3d.config.schema import Config, ModelConfig
from trainer3d.model.transformer import Transformer
from trainer3d.parallel.pipeline.bubble import StageClock, bubble_theory
from trainer3d.parallel.pipeline.schedule import SCHEDULES, SINGLE_STAGE
from trainer3d.parallel.pipeline.stages import rank_of_stage, split_into_stages, stage_layer_ranges, stages_of_rank
from trainer3d.parallel.pipeline.timeline import schedule_bubble, simulate, torch_schedule
from trainer3d.config.validate_pipeline import pipeline_micro_batch_problem


def counts(ranges):
    return [len(r) for r in ranges]


@pytest.mark.parametrize("n_layers,n_stages,expected", [
    (8, 2, [4, 4]), (8, 4, [2, 2, 2, 2]), (4, 4, [1, 1, 1, 1]),
    (10, 4, [3, 3, 2, 2]),  # remainder to the first stages: the last one carries the head and loss
    (7, 2, [4, 3]), (5, 3, [2, 2, 1]),
])
def test_balanced_split(n_layers, n_stages, expected):
    ranges = stage_layer_ranges(n_layers, n_stages)
    assert counts(ranges) == expected
    assert [i for r in ranges for i in r] == list(range(n_layers)), "contiguous, in order, each layer once"


def test_uneven_override():
    ranges = stage_layer_ranges(8, 3, [2, 5, 1])
    assert [list(r) for r in ranges] == [[0, 1], [2, 3, 4, 5, 6], [7]]


@pytest.mark.parametrize("bad", [[4, 4, 1], [4], [0, 8], [5, 4]])
def test_bad_override_is_refused(bad):
    with pytest.raises(ValueError, match="pp_layers"):
        stage_layer_ranges(8, 2, bad)


def test_too_few_layers_is_refused():
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layer_ranges(3, 4)


def test_interleaved_assignment_matches_torch():
    """Rank r runs stages r, r+pp, ...: the mapping torch's interleaved schedules use."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for pp, v in [(2, 2), (4, 2), (2, 3)]:
        torch_map = generate_stage_to_rank_mapping(pp, pp * v)
        for rank in range(pp):
            assert stages_of_rank(rank, pp, v) == sorted(s for s, r in torch_map.items() if r == rank)
    assert stages_of_rank(1, 4, 2) == [1, 5]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_assignment_matches_torch(schedule):
    """zbv and dualpipev: rank r runs stages r and 2 pp - 1 - r, torch's "v" mapping; the last
    stage (head and loss) is on rank 0, with the first."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for pp in (2, 3, 4):
        torch_map = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        for rank in range(pp):
            assert sorted(stages_of_rank(rank, pp, 2, schedule)) == sorted(s for s, r in torch_map.items() if r == rank)
        assert all(rank_of_stage(s, pp, schedule) == r for s, r in torch_map.items())
    assert stages_of_rank(0, 4, 2, schedule) == [0, 7] and stages_of_rank(3, 4, 2, schedule) == [3, 4]


def _cfg(n_layers=8, pp=2, v=1, pp_layers=None):
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50)
    cfg.parallel.pp, cfg.parallel.pp_virtual_stages, cfg.parallel.pp_layers = pp, v, pp_layers
    cfg.parallel.pp_schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    return cfg


@pytest.mark.parametrize("pp,v,pp_layers", [(2, 1, None), (4, 1, None), (2, 2, None), (4, 2, None), (2, 1, [3, 5])])
def test_split_covers_the_model_once_on_meta(pp, v, pp_layers):
    cfg = _cfg(pp=pp, v=v, pp_layers=pp_layers)
    with torch.device("meta"):
        full = Transformer(cfg.model)
    full_names = {n for n, _ in full.named_parameters()}
    seen = []
    for rank in range(pp):
        with torch.device("meta"):
            model = Transformer(cfg.model)
        chunks = split_into_stages(model, cfg, SimpleNamespace(pp_rank=rank))
        assert len(chunks) == v
        assert len({id(p) for c in chunks for p in c.parameters()}) == sum(1 for c in chunks for _ in c.parameters()), \
            "chunks must not share parameters"
        for chunk, stage in zip(chunks, stages_of_rank(rank, pp, v)):
            assert all(p.is_meta for p in chunk.parameters()), "chunks stay on meta until materialised"
            assert (chunk.tok_embeddings is not None) == (stage == 0)
            assert (chunk.output is not None) == (chunk.norm is not None) == (stage == pp * v - 1)
            seen += [n for n, _ in chunk.named_parameters()]
    assert sorted(seen) == sorted(full_names), "every parameter on exactly one stage, under its 1-rank name"


def test_split_keeps_global_layer_names():
    cfg = _cfg(pp=2, v=2)  # 8 layers, 4 stages: rank 1 runs stages 1 (layers 2-3) and 3 (6-7)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    chunks = split_into_stages(model, cfg, SimpleNamespace(pp_rank=1))
    assert [list(c.layers.keys()) for c in chunks] == [["2", "3"], ["6", "7"]]


# ----------------------------------------------------------------- schedule rules vs torch itself

def _fake_stages(pp, v):
    """Enough of a PipelineStage for torch's schedule constructors, which hold the rules."""
    return [SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=0, stage_index=k * pp)
            for k in range(v)]


def _torch_accepts(schedule, pp, v, n):
    try:
        if schedule == "interleaved_1f1b":
            ScheduleInterleaved1F1B(_fake_stages(pp, v), n, loss_fn=lambda o, t: o, scale_grads=False)
        elif schedule in SCHEDULES and schedule not in SINGLE_STAGE:  # zero-bubble: timeline.py's stand-ins
            torch_schedule.__wrapped__(schedule, pp, v, n)
        else:
            cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            cls(_fake_stages(pp, 1)[0], n, loss_fn=lambda o, t: o, scale_grads=False)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 1),
                                        ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zb1p", 1), ("zb1p", 2),
                                        ("zbv", 2), ("dualpipev", 2)])
def test_micro_batch_rule_matches_torch(schedule, v):
    """Validation refuses exactly the micro-batch counts torch's schedule refuses."""
    for pp in (2, 3, 4, 8):
        for n in range(1, 4 * pp + 3):
            problem = pipeline_micro_batch_problem(schedule, pp, n)
            assert (problem is None) == _torch_accepts(schedule, pp, v, n), (schedule, pp, v, n, problem)


def test_micro_batch_rule_messages_name_the_knob():
    assert "train.grad_accum_steps>=4" in pipeline_micro_batch_problem("1f1b", 4, 3)
    message = pipeline_micro_batch_problem("interleaved_1f1b", 2, 5)
    assert "set train.grad_accum_steps=4 or 6" in message
    for suggested in (4, 6):
        assert pipeline_micro_batch_problem("interleaved_1f1b", 2, suggested) is None
    assert pipeline_micro_batch_problem("1f1b", 1, 1) is None


# ----------------------------------------------------------------- bubble arithmetic

def test_bubble_theory():
    assert bubble_theory(2, 2) == pytest.approx(1 / 3)
    assert bubble_theory(4, 4) == pytest.approx(3 / 7)
    assert bubble_theory(4, 32) == pytest.approx(3 / 35)
    assert bubble_theory(4, 8, virtual_stages=2) == pytest.approx(3 / 22)


def test_unit_cost_bubble_of_each_schedule_by_hand():
    """timeline.simulate on torch's action lists, against counts made by hand. 1F1B and GPipe,
    pp=2, m=4: 5 slots of F + B (3 units), 4 busy: 1/5. Interleaved, pp=2, v=2, m=4: the exact
    (p - 1) / (v m + p - 1) = 1/9. ZB-V, pp=2, m=4: rank 0's 24 half-unit actions (12 units)
    end at 12.5 on both ranks (rank 1 starts its first F at 0.5): 0.5 / 12.5 = 0.04."""
    assert schedule_bubble("1f1b", 2, 1, 4) == pytest.approx(1 / 5)
    assert schedule_bubble("gpipe", 2, 1, 4) == pytest.approx(1 / 5)
    assert schedule_bubble("interleaved_1f1b", 2, 2, 4) == pytest.approx(1 / 9)
    assert schedule_bubble("zbv", 2, 2, 4) == pytest.approx(0.5 / 12.5)
    for pp, m in [(4, 8), (4, 16), (8, 32)]:  # zero-bubble fills what 1F1B leaves idle
        assert schedule_bubble("zbv", pp, 2, m) < schedule_bubble("interleaved_1f1b", pp, 2, m) \
            < schedule_bubble("1f1b", pp, 1, m) == pytest.approx(bubble_theory(pp, m))
        assert bubble_theory(pp, m, 2, "zbv") == schedule_bubble("zbv", pp, 2, m)


def test_simulate_refuses_an_order_that_deadlocks():
    with pytest.raises(ValueError, match="deadlocks"):
        simulate({0: (("B", 0, 0), ("F", 0, 0)), 1: (("F", 1, 0), ("B", 1, 0))}, 1)


def test_stage_clock_counts_only_busy_work():
    ticks = iter(range(100))
    clock = StageClock(torch.device("cpu"))
    clock._now = lambda: float(next(ticks))  # a fake clock: every reading advances one second
    clock.start_step()                       # t=0
    with clock.busy():                       # 1..2: busy 1 s
        pass
    with clock.busy():                       # 3..4: busy 1 s
        pass
    clock.end_step()                         # t=5: wall 5 s
    with clock.busy():                       # outside a step: not counted
        pass
    assert clock.pop_times() == [(2.0, 5.0)]
    assert clock.pop_bubbles() == []
    clock.start_step()
    clock.timed(lambda: None)()
    clock.end_step()
    assert clock.pop_bubbles() == [pytest.approx(1 - 1 / 3)]


def test_dry_run_plan_shows_the_stages():
    from trainer3d.memory.dry_run import describe_plan
    from trainer3d.config.validate import validate

    cfg = _cfg(n_layers=10, pp=4)
    cfg.parallel.dp, cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 2, 16
    plan = describe_plan(validate(cfg))
    assert "pipeline: 1f1b, 4 stages, 8 micro-batches, bubble_theory 0.273" in plan  # 3 / (8 + 3)
    assert "stage 0 (pp rank 0): layers 0-2" in plan and "stage 3 (pp rank 3): layers 8-9" in plan


# ----------------------------------------------------------------- the saved-activation meter

def test_meter_counts_saved_tensors_once_until_backward_frees_them():
    from trainer3d.memory.meter import SavedActivationMeter

    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(16, 64, requires_grad=True)
    with SavedActivationMeter([w]) as meter:
        h = x @ w                 # saves x (and w: a parameter, not counted)
        y = (h * h).sum()         # saves h twice: one storage, counted once
        assert meter.live_bytes == x.nbytes + h.nbytes == 16 * 64 * 4 + 16 * 32 * 4
        y.backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == x.nbytes + h.nbytes


@pytest.mark.parametrize("schedule, virtual", [("zbv", 2), ("dualpipev", 2), ("zb1p", 1), ("zb1p", 3)])
def test_the_one_pass_unshard_reshard_lowering_is_torchs(schedule, virtual):
    """receive_count.with_unshard_reshard against torch's own ``_add_unshard_reshard`` on every
    rank's actions, with prefetch windows below, at and above the rank's stage count (torch's
    own called at and below it; DualPipeV's overlapped F;B pairs included)."""
    from torch.distributed.pipelining.schedules import _add_unshard_reshard

    from trainer3d.parallel.pipeline.receive_count import with_unshard_reshard
    from trainer3d.parallel.pipeline.timeline import torch_order

    for pp, m in [(2, 3), (4, 8), (3, 12)]:
        for rank, actions in torch_order(schedule, pp, virtual, m).items():
            for window in (1, 2, 3, 4):
                assert with_unshard_reshard(list(actions), window) == _add_unshard_reshard(list(actions), window), \
                    (pp, m, rank, window)


def test_the_one_pass_interleaved_receive_count_is_torchs():
    """receive_count's interleaved 1F1B count against the count over torch's own
    ``_add_send_recv`` (torch 2.13 schedules.py) on every rank, for pp 2-5, 2-4 chunks per rank
    and every micro-batch count validate() lets ScheduleInterleaved1F1B run up to 3 pp + 2
    (below pp, equal rounds, and counts that are not multiples of pp)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _add_send_recv, _ComputationType as C

    from trainer3d.config.validate_pipeline import pipeline_micro_batch_problem
    from trainer3d.parallel.pipeline.receive_count import receive_buffers_held

    def torch_count(pp, virtual, m):
        plan = SimpleNamespace(n_local_stages=virtual, microbatches_per_round=m // max(1, m // pp),
                               pp_group_size=pp, _n_microbatches=m)
        compute = {r: [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(plan, r) if a]
                   for r in range(pp)}
        held = []
        for actions in _add_send_recv(compute, lambda stage: stage % pp, pp * virtual).values():
            live = peak = 0
            for a in actions:  # a buffer: from its receive to its micro-batch's backward on that stage
                live += a.computation_type in (C.RECV_F, C.RECV_B)
                peak = max(peak, live)
                if a.computation_type == C.FULL_BACKWARD:
                    live -= (a.stage_index > 0) + (a.stage_index < pp * virtual - 1)
            held.append(peak)
        return held

    compared = 0
    for pp in range(2, 6):
        for virtual in range(2, 5):
            for m in range(1, 3 * pp + 3):
                if pipeline_micro_batch_problem("interleaved_1f1b", pp, m) is None:
                    ours = [receive_buffers_held("interleaved_1f1b", pp, virtual, m, r) for r in range(pp)]
                    assert ours == torch_count(pp, virtual, m), (pp, virtual, m)
                    compared += 1
    assert compared == 3 * (6 + 8 + 10 + 13)  # 3 chunk counts x the runnable counts of pp 2, 3, 4, 5


def test_the_zero_bubble_receive_count_is_torchs():
    """receive_count's zero-bubble count against the count over torch's own ``_add_send_recv``
    (torch 2.13 schedules.py) on the same lowered lists, every rank, for ZBV, DualPipeV and
    ZB1P (1-3 stages a rank), pp 2-4 and every micro-batch count validate() lets them run up to
    2 pp + 2 (fewer than pp, equal rounds, and counts that are not multiples of pp)."""
    from torch.distributed.pipelining.schedules import _add_reduce_grad, _add_send_recv, _ComputationType as C

    from trainer3d.config.validate_pipeline import pipeline_micro_batch_problem
    from trainer3d.parallel.pipeline.placement import rank_of_stage
    from trainer3d.parallel.pipeline.receive_count import receive_buffers_held, with_unshard_reshard
    from trainer3d.parallel.pipeline.timeline import torch_order

    def torch_count(schedule, pp, virtual, m):
        lowered = {r: _add_reduce_grad(with_unshard_reshard(actions), m)
                   for r, actions in torch_order(schedule, pp, virtual, m).items()}
        held = []
        for actions in _add_send_recv(lowered, lambda s: rank_of_stage(s, pp, schedule), pp * virtual).values():
            live, count, peak = {}, 0, 0  # a buffer: from its receive to its micro-batch's B or W on that stage
            for a in (sub for top in actions for sub in (top.sub_actions or (top,))):
                kind, key = a.computation_type, (a.stage_index, a.microbatch_index)
                if kind in (C.RECV_F, C.RECV_B) and kind not in live.setdefault(key, set()):
                    live[key].add(kind)
                    count += 1
                    peak = max(peak, count)
                elif kind in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
                    count -= len(live.pop(key, ()))
            held.append(peak)
        return held

    compared = 0
    for schedule, chunks in [("zbv", [2]), ("dualpipev", [2]), ("zb1p", [1, 2, 3])]:
        for pp in range(2, 5):
            for virtual in chunks:
                for m in [m for m in range(1, 2 * pp + 3) if pipeline_micro_batch_problem(schedule, pp, m) is None]:
                    assert [receive_buffers_held(schedule, pp, virtual, m, r) for r in range(pp)] == \
                        torch_count(schedule, pp, virtual, m), (schedule, pp, virtual, m)
                    compared += 1
    assert compared == (6 + 8 + 10) + (3 + 3 + 3) + 3 * (5 + 7 + 9)  # zbv, dualpipev (m >= 2 pp), zb1p x 3


def test_the_steady_count_holds_the_figures_of_every_larger_one():
    """timeline.steady_micro_batches: from 2 pp micro-batches on (a multiple of pp for zb1p and
    interleaved_1f1b), the receive count, the micro-batches in flight at each count a rank passes
    through and every rank's idle time equal 2 pp's, for each multi-chunk schedule, pp 2-4 and
    1-4 chunks a rank; and the receive count, in-flight counts and bubble the memory estimate and
    the step-time model take from the steady count are, bit for bit, what m's own simulation gives."""
    from trainer3d.memory.in_flight import _states, in_flight
    from trainer3d.parallel.pipeline.receive_count import (_interleaved_held, _zero_bubble_held,
                                                           receive_buffers_held)
    from trainer3d.parallel.pipeline.timeline import STEADY_FROM, schedule_actions, steady_micro_batches

    def figures(schedule, pp, v, m):
        held = _interleaved_held(pp, v, m) if schedule == "interleaved_1f1b" else _zero_bubble_held(schedule, pp, v, m)
        chunks = [len(stages_of_rank(r, pp, v, schedule)) for r in range(pp)]
        flight = tuple(_states(schedule, pp, v, m, r, chunks[r]) for r in range(pp))
        if schedule == "interleaved_1f1b":
            return held, flight, None
        line = simulate(schedule_actions(schedule, pp, v, m), v)
        idle = line.makespan - 3 * m, [sum(e - s for s, e, _ in spans) - 3 * m for spans in line.spans.values()]
        return held, flight, idle, line.bubble()

    reduced = compared = 0
    for schedule, chunks in [("zbv", [2]), ("dualpipev", [2]), ("zb1p", [1, 2, 3, 4]),
                             ("interleaved_1f1b", [2, 3, 4])]:
        for pp in range(2, 5):
            period = 1 if schedule in ("zbv", "dualpipev") else pp
            for v in chunks:
                steady = figures(schedule, pp, v, 2 * pp)
                for m in range(2 * pp, (STEADY_FROM + 2) * pp + 1):
                    if pipeline_micro_batch_problem(schedule, pp, m):
                        continue
                    ours = figures(schedule, pp, v, m)
                    if m % period == 0:  # zb1p and interleaved_1f1b at m % pp: rounds of another size
                        assert ours[:2] == steady[:2], (schedule, pp, v, m)
                        if v != 3 and schedule != "interleaved_1f1b":  # unit costs of 1/3 do not add up exactly
                            assert ours[2] == steady[2], (schedule, pp, v, m)
                    # what the planner asks: the steady count's figures, m's own bubble
                    assert [receive_buffers_held(schedule, pp, v, m, r) for r in range(pp)] == list(ours[0])
                    if schedule != "interleaved_1f1b":
                        assert schedule_bubble(schedule, pp, v, m) == ours[3], (schedule, pp, v, m)
                    cfg = Config()
                    cfg.parallel.pp, cfg.parallel.pp_virtual_stages, cfg.parallel.pp_schedule = pp, v, schedule
                    cfg.train.grad_accum_steps = m
                    for r in range(pp):  # the peak over m's own counts, first reached
                        per_micro = [1000 + 10 * c for c in range(len(ours[1][r][0]))]
                        per_step = [7 * c + 1 for c in range(len(per_micro))]
                        best = (0, [0] * len(per_micro))
                        for counts in ours[1][r]:
                            live = sum(n * b + (s if n else 0) for n, b, s in zip(counts, per_micro, per_step))
                            best = (live, list(counts)) if live > best[0] else best
                        assert in_flight(cfg, r, per_micro, per_step) == best, (schedule, pp, v, m, r)
                    reduced += steady_micro_batches(schedule, pp, m) != m
                    compared += 1
    assert reduced == 2 * (2 + 3 + 4) * 2 + 2 * 3 * (4 + 3), reduced  # m past STEADY_FROM pp
    # zbv, dualpipev: every m from 2 pp to 5 pp; zb1p, interleaved_1f1b: 4 multiples of pp a pp, and
    # the counts torch runs in rounds of more than pp (8 at pp 3, 10 and 15 at pp 4)
    assert compared == 2 * (7 + 10 + 13) + (4 + 3) * (3 * 4 + 3), compared
