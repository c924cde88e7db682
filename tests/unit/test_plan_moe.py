"""The planner's mixture-of-experts terms against hand counts: the all-to-all (two forward, two
backward per MoE block, over the ep group's links), the experts' gradient reduction over
dp x cp / ep, FLOPs from active parameters, and ep in the search (plan/moe_cost.py,
plan/expert_search.py)."""


from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
import trainer3d.config.composed  # noqa: F401  (registers the schema in the ConfigStore)
import trainer3d.plan.composed  # noqa: F401  (registers the planner's schema in the ConfigStore)
from trainer3d.config.validate import validate
from trainer3d.plan.block_time import block_time
from trainer3d.plan.devices import PRESETS
from trainer3d.plan.expert_search import expert_parallel_sizes
from trainer3d.plan.moe_cost import all_to_all_s, expert_gradient_bytes
from trainer3d.plan.search import search
from trainer3d.plan.micro_batch_time import micro_batch_times

H100 = PRESETS["h100-sxm"]


def _compose(name, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(name, list(overrides)))


def _mixtral(tp=1, dp=8, ep=1, micro=1, seq=4096, sp=False):
    """A validated Mixtral layout."""
    cfg = _compose("config", "model=mixtral-8x7b", "parallel=single", "run_dir=.", "launcher.folder=.", "train.dtype=bf16",
                   f"parallel.tp={tp}", f"parallel.dp={dp}", f"parallel.ep={ep}",
                   f"parallel.sequence_parallel={str(sp).lower()}", f"train.micro_batch_size={micro}",
                   f"train.seq_len={seq}", f"train.global_batch_size={micro * dp}", "train.grad_accum_steps=null")
    return validate(cfg)


def test_all_to_all_moves_the_routed_slots_bound_for_other_ranks_over_the_ep_groups_link():
    # tp 1, ep 4 inside a node: 4096 tokens x top-2 = 8192 slots of 4096 bf16, 3/4 leave the rank
    cfg = _mixtral(ep=4)
    lat = H100.latency(8) * 1e-6
    want = 8192 * 4096 * 2 * 3 / 4 / (H100.intra_gbps * 1e9) + 3 * lat
    assert abs(all_to_all_s(cfg, H100, 8) - want) <= 1e-12 * want
    # tp 4 x ep 4 spans 16 ranks: two nodes, one member of the ep group per node... each through its NIC
    wide = _mixtral(tp=4, dp=16, ep=4, sp=True)  # sequence parallel: a tp rank routes 4096 / 4 tokens
    span_gbps = min(H100.intra_gbps, H100.inter_gbps * 2)  # 2 ep members per node (8 // tp)
    want = 2048 * 4096 * 2 * 3 / 4 / (span_gbps * 1e9) + 3 * lat
    assert abs(all_to_all_s(wide, H100, 8) - want) <= 1e-12 * want
    assert all_to_all_s(_mixtral(ep=1), H100, 8) == 0.0


def test_step_charges_four_all_to_alls_per_moe_block_and_micro_batch():
    cfg = _mixtral(ep=8)
    times = micro_batch_times(cfg, H100, 0, 8)
    assert abs(times.terms["ep_comm"] - 32 * 4 * all_to_all_s(cfg, H100, 8)) <= 1e-9 * times.terms["ep_comm"]
    assert "ep_comm" not in micro_batch_times(_mixtral(ep=1), H100, 0, 8).terms


def test_expert_gradients_are_split_from_the_rest_by_ep():
    cfg = _mixtral(ep=4)
    expert_params = 32 * 3 * 8 * 4096 * 14336  # w1, w3, w2 of 8 experts in 32 blocks
    rest, experts = expert_gradient_bytes(cfg, 0, 10 ** 12)
    assert experts == 4 * expert_params // 4 and rest == 10 ** 12 - experts
    assert expert_gradient_bytes(_mixtral(ep=1), 0, 10 ** 12) == (10 ** 12, 0)


def test_cpu_rate_block_counts_the_active_parameters():
    """A device known by one rate (CPUs): an MoE block's gemm seconds are its active weights'
    FLOPs (router, top-2 experts) plus attention's, over the rate."""
    cfg = _mixtral(seq=256)
    cpu = PRESETS["cpu"]
    m = cfg.model
    attention = m.dim * 128 * (2 * 32 + 2 * 8)
    active = m.dim * 8 + 2 * 3 * m.dim * 14336
    flops = 256 * (2 * (attention + active) + 2 * 256 * 32 * 128)
    rate = cpu.matmul_tflops["bf16"] * 1e12 * cpu.rank_speed(1)
    got = block_time(cfg, cpu, 1, moe=True).fwd["gemm"]
    assert abs(got - flops / rate) <= 1e-9 * got


def test_ep_sizes_divide_the_group_and_the_experts():
    assert expert_parallel_sizes(0, 8) == [1]
    assert expert_parallel_sizes(8, 64) == [1, 2, 4, 8]
    assert expert_parallel_sizes(64, 12) == [1, 2, 4]


def test_search_tries_every_ep_that_divides_the_group_and_the_experts():
    """tiny-moe (4 experts) on one CPU node of 4 ranks: layouts with ep 1, 2 and 4 are plans,
    each one validate() accepts (ep divides dp x cp, ZeRO 0/1)."""
    cfg = _compose("plan", "model=tiny-moe", "cluster.nodes=1", "cluster.gpus_per_node=4", "cluster.gpu=cpu",
                   "train.global_batch_size=16", "train.seq_len=64", "search.micro_batch_sizes=[1,2]")
    result = search(cfg, PRESETS["cpu"])
    assert {plan.cfg.parallel.ep for plan in result.plans} == {1, 2, 4}
    for plan in result.plans:
        p = plan.cfg.parallel
        assert (p.dp * p.cp) % p.ep == 0 and p.zero_stage <= 1


def test_expert_gradients_of_a_v_schedule_are_those_of_its_two_stages():
    """Under a V (zbv, dualpipev) pp rank r runs stages r and 2 pp - 1 - r, not r and r + pp: with
    uneven stages (pp_layers 1, 1, 1, 3) rank 0 holds the last stage's 3 MoE blocks. Built without
    validate(), which refuses MoE under zero-bubble schedules today; the planner's term must not
    depend on that refusal."""
    cfg = _compose("config", "model=tiny-moe", "model.n_layers=6", "parallel=single", "run_dir=.", "launcher.folder=.",
                   "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.pp_schedule=zbv",
                   "parallel.pp_virtual_stages=2", "parallel.pp_layers=[1,1,1,3]")
    m = cfg.model
    per_block = 3 * m.moe.num_experts * m.dim * m.ffn_dim // 2  # w1, w3, w2 of every expert, over ep 2
    assert expert_gradient_bytes(cfg, 0, 10 ** 9)[1] == 4 * per_block * (1 + 3)  # stages 0 and 3
    assert expert_gradient_bytes(cfg, 1, 10 ** 9)[1] == 4 * per_block * (1 + 1)  # stages 1 and 2
