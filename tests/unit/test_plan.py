"""The layout planner: its commands pass validate(), its search is bounded, what does not fit
is dropped with the reason, and the step-time model against hand-derived figures."""

import dataclasses
import inspect
import multiprocessing
import os
import time
import importlib.util

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, ROOT
from trainer3d.memory import rank_layout
from trainer3d.memory import states as memory
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.schema import Config
from trainer3d.memory.states import format_bytes
from trainer3d.model.flops import layer_matmul_params, matmul_params
from trainer3d.plan.devices import PRESETS, Device, device_for, load_calibration
from trainer3d.plan.search import evaluate, search
from trainer3d.config.validate import validate



def _plan_config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("plan", list(overrides)))


def _training_config(overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", [*overrides, "run_dir=.", "launcher.folder=."]))


def test_planner_prints_ranked_layouts_whose_commands_pass_validate():
    """What ``python -m trainer3d.plan`` prints (trainer3d/plan/__main__.py: ``report`` of its
    ``search``), made in this process; the entry point itself runs in
    tests/tools/test_doc_commands_run.py."""
    from trainer3d.plan.report import report

    args = ["model=7b", "cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.gpu=h100-sxm",
            "train.global_batch_size=1024", "train.seq_len=4096", "search.top=4"]
    cfg = _plan_config(*args)
    device = device_for(cfg.cluster.gpu, cfg.cluster.calibration)
    stdout = report(cfg, device, search(cfg, device), args)
    assert "ranks; global batch 1024 x 4096 tokens, bf16" in stdout
    commands = [line.split(None, 1)[1] for line in stdout.splitlines()
                if line.strip()[:1].isdigit() and "python -m trainer3d.train" in line]
    assert len(commands) == 4
    table = stdout.split("  #  tp", 1)[1].split("\n\n", 1)[0].splitlines()[1:]  # the ranked table's rows
    rows = [line.split() for line in table]
    assert len(rows) == 4, table
    speeds = [float(r[-2].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True)  # fastest first
    for command in commands:
        overrides = command.split()[3:]
        assert "model=7b" in overrides
        cfg = validate(_training_config(overrides))  # raises if the engine would refuse it
        assert cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp == 16
        assert cfg.launcher.nodes * cfg.launcher.tasks_per_node == 16
        assert cfg.train.global_batch_size == 1024 and cfg.train.seq_len == 4096


def test_search_of_1024_gpus_is_bounded_and_builds_one_meta_block_per_tp():
    memory._MODEL_SHAPES.clear()
    rank_layout._LAYOUTS.clear()  # the ranks' layouts keep the shapes they were built from
    cfg = _plan_config("model=70b", "cluster.nodes=128", "cluster.gpus_per_node=8", "train.global_batch_size=1024",
                       "train.seq_len=4096")
    result = search(cfg, device_for("h100-sxm"))
    # 4 tp x 7 pp x 5 micro-batch sizes x zero stages x SP x recompute x schedules, less the
    # combinations that only shape the space (ZeRO 2/3 with pp > 1, more stages than layers)
    assert 1000 < result.evaluated <= 3000, result.evaluated
    assert len(memory._MODEL_SHAPES) == 4  # tp 1, 2, 4, 8: one meta-built block each
    assert result.plans and sum(result.refused.values()) + result.over_memory + len(result.plans) == result.evaluated
    usable = PRESETS["h100-sxm"].usable_bytes(8)
    assert all(plan.memory.total <= usable for plan in result.plans)


def test_what_does_not_fit_is_dropped_with_how_far_over():
    from trainer3d.plan.report import report

    cfg = _plan_config("model=70b", "cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=a100-40g",
                       "train.global_batch_size=64", "train.seq_len=4096")
    device = device_for("a100-40g")
    result = search(cfg, device)
    assert not result.plans and result.over_memory > 0
    over, layout, rank = result.closest_over
    # the closest miss is at least the 70b model states sharded 8 ways minus the usable memory
    assert over > 0 and layout.parallel.tp * layout.parallel.pp * layout.parallel.dp == 8
    text = report(cfg, device, result, [])
    assert f"over by {format_bytes(over)} on stage {rank}" in text and "no layout fits" in text


def test_unknown_device_and_missing_calibration_name_the_knob(tmp_path):
    with pytest.raises(ValueError, match="cluster.gpu=h900 is not one of h100-sxm"):
        device_for("h900")
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        device_for("calibrated", str(tmp_path / "none.json"))
    written = dataclasses.asdict(PRESETS["cpu"])
    (tmp_path / "c.json").write_text(__import__("json").dumps(written))
    assert load_calibration(str(tmp_path / "c.json")) == PRESETS["cpu"]


# ------------------------------------------------------------------ the step-time model

def _ideal(**changes) -> Device:
    """Matmuls at 1 TFLOP/s, everything else free: the step is FLOPs and the bubble."""
    fields = dict(name="ideal", memory_gib=80, reserved_gib=0, matmul_tflops={"fp32": 1.0, "bf16": 1.0},
                  memory_gbps=1e12, intra_gbps=1e12, inter_gbps=1e12, latency_us=0.0, source="test")
    fields.update(changes)
    return Device(**fields)


def _cfg(**parallel) -> Config:
    cfg = Config()
    cfg.model.n_layers = 8
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 16, None
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return validate(cfg)


def _step(cfg, device, ranks_per_node=8):
    return evaluate(cfg, device, ranks_per_node, "nccl").step


def test_compute_is_the_causal_model_flops_over_the_rate():
    cfg = _cfg()
    m, t = cfg.model, cfg.train
    tokens = t.global_batch_size * t.seq_len
    # forward + backward = 3 x (2 per matmul weight + 2 s h per block for causal attention scores)
    flops = 3 * tokens * (2 * matmul_params(m) + m.n_layers * 2 * t.seq_len * m.dim)
    assert _step(cfg, _ideal()).total == pytest.approx(flops / 1e12, rel=1e-9)
    assert layer_matmul_params(m) * m.n_layers + m.dim * m.vocab_size == matmul_params(m)


@pytest.mark.parametrize("pp,virtual", [(2, 1), (4, 1), (4, 2)])
def test_bubble_is_p_minus_1_over_v_m(pp, virtual):
    """(p - 1) / (v m) of the compute: fill and drain of the slowest stage (the one with the head)."""
    cfg = _cfg(pp=pp, pp_schedule="interleaved_1f1b" if virtual > 1 else "1f1b", pp_virtual_stages=virtual)
    step = _step(cfg, _ideal())
    assert step.bubble / step.compute == pytest.approx((pp - 1) / (virtual * cfg.train.grad_accum_steps))
    assert step.total == pytest.approx(step.compute + step.bubble)


def test_data_parallel_reduction_hides_behind_backward_but_its_last_bucket():
    cfg = _cfg(dp=2, bucket_mb=0.5)
    states = memory.engine_model_state_bytes(memory.rank_parameter_shapes(cfg, 0), 2, 0, "fp32", 2 ** 19 // 4)
    ring_s = states.grads / 1e9  # 2 (n - 1) / n of the fp32 gradients over 1 GB/s, n = 2
    last_bucket_s = ring_s * 2 ** 19 / states.grads
    fast = _step(cfg, _ideal(intra_gbps=1.0, memory_gbps=1e12))
    backward_s = 2 / 3 * fast.compute / cfg.train.grad_accum_steps  # the last micro-batch's
    # the reduction launched during the last backward: only its last bucket and what overruns it shows
    assert fast.dp_comm == pytest.approx(last_bucket_s + max(0.0, ring_s - last_bucket_s - backward_s), rel=1e-6)
    slow = _step(cfg, _ideal(intra_gbps=1e-3))
    assert slow.dp_comm == pytest.approx(1000 * ring_s - backward_s, rel=1e-6)


def test_zero1_parameter_gather_hides_behind_the_next_forward_but_its_first_bucket():
    cfg = _cfg(dp=2, bucket_mb=0.5, zero_stage=1)
    states = memory.engine_model_state_bytes(memory.rank_parameter_shapes(cfg, 0), 2, 1, "fp32", 2 ** 19 // 4)
    share = 2 ** 19 / states.grads  # one bucket of the fp32 gradients (NCCL: reduce-scattered)
    scatter_s, gather_s = states.grads / 2 / 1e9, states.params / 2 / 1e9  # (n - 1) / n over 1 GB/s, n = 2
    fast = _step(cfg, _ideal(intra_gbps=1.0, memory_gbps=1e12))
    forward_s = fast.compute / 3 / cfg.train.grad_accum_steps  # one micro-batch's
    overrun = {"scatter": max(0.0, scatter_s * (1 - share) - 2 * forward_s),
              "gather": max(0.0, gather_s * (1 - share) - forward_s)}
    assert fast.dp_comm == pytest.approx((scatter_s + gather_s) * share + sum(overrun.values()), rel=1e-6)
    slow = _step(cfg, _ideal(intra_gbps=1e-3))
    assert slow.dp_comm == pytest.approx(1000 * (scatter_s + gather_s) - 3 * forward_s, rel=1e-6)


def test_shared_cores_bound_a_step_by_the_nodes_work():
    """Eight ranks on a node that computes like one rank: a step takes at least eight ranks' work."""
    cpu = _ideal(node_scaling={1: 1.0, 8: 1.0}, cores=1, shared_memory=True)
    cfg = _cfg(dp=8, zero_stage=0)
    cfg.train.grad_accum_steps = 2
    step = _step(cfg, cpu, ranks_per_node=8)
    assert step.node_bound == pytest.approx(8 * step.compute)
    assert step.total == pytest.approx(step.node_bound + step.dp_comm + step.optimizer)


# ------------------------------------------------------------------ the accuracy tool's pure parts

def _accuracy_tool():
    spec = importlib.util.spec_from_file_location("plan_accuracy", ROOT / "tools" / "bench" / "plan_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accuracy_tool_layouts_are_valid_and_its_rank_correlation_is_spearmans():
    tool = _accuracy_tool()
    assert tool.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tool.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert tool.ranks([5.0, 1.0, 5.0]) == [2.5, 1.0, 2.5]
    # 1 - 6 sum d^2 / (n (n^2 - 1)) for distinct ranks: d = (0, 1, -1, 0, 0)
    assert tool.spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(1 - 6 * 2 / (5 * 24))
    worlds = set()
    for layout in tool.LAYOUTS:
        cfg = tool.training_config([*tool.COMMON, *layout.split()])
        worlds.add(cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp)
        assert evaluate(cfg, PRESETS["cpu"], 8, "gloo").step.total > 0
    assert len(tool.LAYOUTS) >= 6 and worlds == {1, 2, 4, 8}


def test_calibration_fits_each_fixed_cost_back_from_a_step_it_predicts():
    """--calibrate fits a fixed cost (step_overhead_us, a hop's latency with N ranks on the node,
    a pipeline action) as the value that makes the model predict the engine's measured step:
    given a step the model predicts with known costs, the fit finds those costs again."""
    from trainer3d.plan.calibrate import PP_PROBES, TINY, TP_PROBES, _fit
    from trainer3d.plan.probe import training_config
    truth = dataclasses.replace(PRESETS["cpu"], step_overhead_us=2500.0, latency_by_ranks={2: 300.0, 4: 900.0},
                                action_by_ranks={2: 700.0})
    tp = training_config([*TINY, *TP_PROBES[4].split()])
    pp = training_config([*TINY, PP_PROBES[2]])

    def total(cfg, ranks, **changes):
        return evaluate(cfg, dataclasses.replace(truth, **changes), ranks, "gloo").step.total
    took = total(tp, 4)
    assert evaluate(tp, truth, 4, "gloo").step.host == pytest.approx(2.5e-3)
    assert _fit(lambda x: total(tp, 4, latency_by_ranks={2: 300.0, 4: x}), took) == pytest.approx(900.0, rel=1e-6)
    assert _fit(lambda x: total(pp, 2, action_by_ranks={2: x}), total(pp, 2)) == pytest.approx(700.0, rel=1e-6)
    assert _fit(lambda x: total(tp, 4, step_overhead_us=x), took / 2) == 0.0  # already slower: nothing to add


def test_the_searchs_own_refused_candidates_are_labelled_not_spoken_as_refusals_of_the_users_config():
    from trainer3d.plan.report import summary_lines

    cfg = _plan_config("model=7b", "cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.gpu=h100-sxm",
                       "train.global_batch_size=64", "train.seq_len=4096")
    device = device_for(cfg.cluster.gpu, cfg.cluster.calibration)
    result = search(cfg, device)
    assert result.refused, "64 sequences on 16 ranks: some candidates' micro-batch x dp overshoots the batch"
    lines = summary_lines(cfg, device, result)
    label = [i for i, line in enumerate(lines) if "candidate layout(s) the search made itself" in line]
    assert len(label) == 1 and "nothing to fix in your config" in lines[label[0]]
    examples = lines[label[0] + 1:]
    assert len(examples) == len(result.refusal_examples)
    for line, (knob, problem) in zip(examples, result.refusal_examples.items()):
        assert line == f"    candidate refused on {knob} ({result.refused[knob]:,}): {problem}"


def test_calibrations_engine_probes_run_each_rank_on_one_thread(monkeypatch):
    """--calibrate's engine probes (a negligible model: a step is host time) run their ranks on
    one thread: with the launcher's share of the cores a step waits at each OpenMP region for a
    second thread, which on a busy machine waits for a core (a 6-step one-process probe: 47-69 s
    a step on 2 threads, 0.5-3 s on one; trainer3d/plan/calibrate.py PROBE_ENV)."""
    from trainer3d.plan import calibrate

    seen = []

    def measured(overrides, steps, warmup, run_dir, env=None):
        seen.append((" ".join(overrides), dict(env or {})))
        return [0.01]

    monkeypatch.setattr(calibrate, "measured_step_s", measured)
    figures = {**dataclasses.asdict(PRESETS["cpu"]), "name": "calibrated"}
    calibrate.engine_figures(figures, max_ranks=2, effort=calibrate.QUICK)
    assert len(seen) == 3 and all(env.get("OMP_NUM_THREADS") == "1" for _, env in seen), seen


def test_the_planners_caches_are_bounded_and_drop_the_least_recently_used():
    """The memos of a layout's rank, states, staged and expert bytes (trainer3d/memory/bounded.py)
    hold at most their size, so a process planning many models stays bounded."""
    from trainer3d.memory import peak, staged
    from trainer3d.memory.bounded import Bounded
    from trainer3d.plan import moe_cost

    assert all(isinstance(c, Bounded) for c in (rank_layout._LAYOUTS, peak._STATES, staged._STAGED,
                                                moe_cost._EXPERT_BYTES))
    made = []
    cache = Bounded(2)
    for key in ["a", "b", "a", "c", "a", "b"]:  # "b" is dropped for "c" ("a" was used since), then "c" for "b"
        assert cache.get(key, lambda key=key: made.append(key) or key.upper()) == key.upper()
    assert made == ["a", "b", "c", "b"] and len(cache) == 2


def _layout(moe=None, train=None, **parallel) -> Config:
    cfg = Config()
    cfg.model.n_layers = 8
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.grad_accum_steps = 2, 16, None
    for group, changes in ((cfg.model.moe, moe), (cfg.train, train), (cfg.parallel, parallel)):
        for key, value in (changes or {}).items():
            setattr(group, key, value)
    return validate(cfg)


def test_the_searchs_block_times_are_kept_by_everything_they_depend_on():
    """search() keeps the block times of all its layouts on its device (micro_batch_time.py
    ``block_key``). Each variant differs from its base layout in one thing a block's time
    depends on: timed after the base with one shared memo, as the search times them, its step
    is the step it gets timed alone, and not the base's (were that thing missing from the key,
    the memo would hand out the base's block). An MoE model keeps a block of each kind."""
    h100 = PRESETS["h100-sxm"]
    rates = _ideal(matmul_tflops={"fp32": 1.0, "bf16": 1.0, "fp16": 2.0})
    hops = _ideal(latency_by_ranks={2: 1.0, 8: 10.0})  # a tp collective's latency by the node's busy ranks
    moe = {"num_experts": 4, "top_k": 2, "first_dense_layers": 1}
    cases = {  # base and variant: (layout, device, ranks per node, attention)
        "micro-batch": ((_layout(tp=2, dp=4), h100, 8, "flash"),
                        (_layout(train={"micro_batch_size": 4}, tp=2, dp=4), h100, 8, "flash")),
        "sequence parallelism": ((_layout(tp=2, dp=4), h100, 8, "flash"),
                                 (_layout(tp=2, dp=4, sequence_parallel=True), h100, 8, "flash")),
        "expert parallelism": ((_layout(moe, dp=4), h100, 8, "flash"), (_layout(moe, dp=4, ep=2), h100, 8, "flash")),
        "attention kernel": ((_layout(tp=2, dp=4), h100, 8, "flash"), (_layout(tp=2, dp=4), h100, 8, "math")),
        "ranks per node": ((_layout(tp=2, dp=4), hops, 8, "flash"), (_layout(tp=2, dp=4), hops, 2, "flash")),
        "dtype": ((_layout(train={"dtype": "bf16"}, tp=2, dp=4), rates, 8, "flash"),  # 2 bytes each
                  (_layout(train={"dtype": "fp16"}, tp=2, dp=4), rates, 8, "flash")),
    }
    for name, ((base, device, per_node, attention), (cfg, _, variant_per_node, variant_attention)) in cases.items():
        blocks = {}
        first = evaluate(base, device, per_node, "nccl", attention, blocks=blocks).step
        shared = evaluate(cfg, device, variant_per_node, "nccl", variant_attention, blocks=blocks).step
        alone = evaluate(cfg, device, variant_per_node, "nccl", variant_attention).step
        assert shared == alone != first, name
        assert len(blocks) == 2 + 2 * (name == "expert parallelism"), (name, list(blocks))
    blocks = {}
    evaluate(_layout(moe, dp=4), h100, 8, "nccl", blocks=blocks)
    assert sorted(key[0] for key in blocks) == [False, True]  # dense and MoE


def _sleep_forever():
    time.sleep(3600)


def _exit_3():
    os._exit(3)


def test_a_probes_wait_is_bounded_and_names_a_failed_rank():
    """trainer3d/plan/calibrate_ranks.py ``wait_ranks``, an engine probe's wait (probe.py): a rank
    that exits non-zero is named (its index) while another still runs, and ranks still running at
    the deadline raise TimeoutError naming them (measured_step_s then kills them) instead of
    waiting on."""
    from trainer3d.plan.calibrate_ranks import wait_ranks
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_sleep_forever, daemon=True), ctx.Process(target=_exit_3, daemon=True)]
    try:
        for p in procs:
            p.start()
        assert wait_ranks(procs, time.monotonic() + 60, "a minute") == 1
        with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 still running"):
            wait_ranks(procs[:1], time.monotonic() + 0.2, "0.2 s")
    finally:
        for p in procs:
            p.kill()
            p.join()


def _put_or_hang(rank, world, pids, hang, out):
    """A calibration rank (calibrate_ranks.py ``run_ranks``' protocol): records its pid, then
    puts its result, or, as rank ``hang``, sleeps without one."""
    (pids / str(rank)).write_text(str(os.getpid()))
    if rank == hang:
        time.sleep(3600)
    out.put(rank)


def _put_then_exit_3(rank, world, out):
    out.put(rank)
    if rank == 1:
        os._exit(3)


def test_calibrations_ranks_are_bounded_and_a_hung_one_is_ended_and_named(tmp_path):
    """--calibrate's own ranks (trainer3d/plan/calibrate_ranks.py ``run_ranks``: the node's matmul
    rates, gloo all-reduce) are bounded as a run is (``RANKS_TIMEOUT_S``: the schema's start-up
    timeout and one collective timeout): a rank that hangs without its result is named in a
    TimeoutError at the deadline and killed; one that hangs after it, in the wait for the ranks'
    exit, too; one that exits non-zero is named. The ranks fork from this process here, not from
    the forkserver, whose start imports torch and the entry point."""
    from trainer3d.config.schema_parallel import ParallelConfig
    from trainer3d.plan import calibrate_ranks
    from trainer3d.plan.calibrate_ranks import run_ranks
    assert calibrate_ranks.RANKS_TIMEOUT_S == ParallelConfig.init_timeout_s + ParallelConfig.timeout_s
    assert inspect.signature(run_ranks).parameters["timeout_s"].default == calibrate_ranks.RANKS_TIMEOUT_S
    ctx = multiprocessing.get_context("fork")
    for results in (2, 1):  # rank 1 hangs before its result; with one result wanted, after rank 0's
        pids = tmp_path / str(results)
        pids.mkdir()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 still running"):
            run_ranks(_put_or_hang, 2, pids, 1, results=results, timeout_s=5, context=ctx)  # time for two forks on a loaded machine
        hung = int((pids / "1").read_text())
        assert not os.path.exists(f"/proc/{hung}"), "the hung rank was left running"
    with pytest.raises(RuntimeError, match="rank 1 of 2 exited 3"):
        run_ranks(_put_then_exit_3, 2, results=2, timeout_s=60, context=ctx)
    (tmp_path / "none").mkdir()
    assert sorted(run_ranks(_put_or_hang, 2, tmp_path / "none", -1, results=2, timeout_s=60, context=ctx)) == [0, 1]
