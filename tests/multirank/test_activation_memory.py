"""Activation memory: trainer3d/memory/activations.py's per-term formula, held to the bytes autograd
really saves, stage by stage, through the real pipeline and trainer (tests/support/activation_ranks.py)."""

import pytest

from tests.support.activation_ranks import layout_config, measure
from tests.support.harness import run_ranks
from trainer3d.memory.activations import Sizes, layer_terms
from trainer3d.memory.in_flight import schedule_ops
from trainer3d.memory.dry_run import peak_lines
from trainer3d.memory.peak import rank_memory, receive_buffer_bytes
from trainer3d.memory.states import format_bytes
from trainer3d.config.validate import validate

# >= 12 layouts mixing tp, pp, sequence parallelism, recomputation, schedules, micro-batch
# sizes, dtypes and the SDPA kernel; grouped by world size (one set of ranks each).
LAYOUTS = {
    1: [dict(), dict(micro=4, recompute=True), dict(dtype="bf16", accum=3), dict(kernel="math"), dict(chunk=0)],
    2: [dict(tp=2), dict(tp=2, sp=True, micro=1), dict(pp=2, accum=4), dict(tp=2, chunk=0),
        dict(pp=2, schedule="gpipe", accum=3, recompute=True),
        dict(pp=2, schedule="interleaved_1f1b", virtual=2, accum=4),
        # zero-bubble: a micro-batch's activations stay until its weight step W
        dict(pp=2, schedule="zbv", virtual=2, accum=4), dict(pp=2, schedule="dualpipev", virtual=2, accum=4),
        dict(pp=2, schedule="zb1p", virtual=2, accum=4)],
    4: [dict(tp=2, pp=2, sp=True), dict(tp=2, pp=2, schedule="gpipe", accum=3, dtype="bf16"),
        dict(tp=2, pp=2, schedule="interleaved_1f1b", virtual=2, accum=4, recompute=True),
        dict(tp=2, pp=2, micro=1, chunk=0),
        dict(pp=4, micro=1, accum=5), dict(tp=4, sp=True, recompute=True, kernel="math"),
        dict(pp=4, schedule="interleaved_1f1b", virtual=2, accum=8, dtype="bf16"),
        dict(pp=4, schedule="zbv", virtual=2, accum=8, micro=1),
        dict(tp=2, pp=2, schedule="zb1p", virtual=2, accum=4, recompute=True, sp=True)],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_predicted_saved_activations_match_the_measured_on_every_stage(world):
    """Run with -s for the table (docs/memory.md holds one)."""
    layouts = LAYOUTS[world]
    results = run_ranks(measure, world, layouts, timeout=600)
    for i, layout in enumerate(layouts):
        cfg = validate(layout_config(**layout))
        name = " ".join(f"{k}={v}" for k, v in layout.items()) or "single process"
        for got in sorted((r[i] for r in results), key=lambda g: (g["pp_rank"], g["tp_rank"])):
            assert got["left"] == 0, (layout, got)  # backward (a zero-bubble W) released every saved tensor
            mem = rank_memory(cfg, got["pp_rank"], layout.get("kernel", "flash"))
            want = mem.activation_bytes
            error = (got["peak"] - want) / want
            print(f"| {name} | {got['pp_rank']} | {got['tp_rank']} | {got['peak']:,} | {want:,} | {error:+.2%} |")
            assert got["peak"] == want, (f"{layout} pp rank {got['pp_rank']} tp rank {got['tp_rank']}: measured "
                                         f"{got['peak']:,} B, predicted {want:,} B ({error:.1%}); in flight "
                                         f"{mem.in_flight}, terms {mem.activations}")
            assert got["receive"] == receive_buffer_bytes(cfg, got["pp_rank"]), (layout, got)
        if cfg.parallel.pp > 1:  # the dry run prints the measured peak of every pp rank
            row = next(line for line in peak_lines(cfg) if line.strip().startswith("activations (saved)"))
            measured = {r[i]["pp_rank"]: r[i]["peak"] for r in results}
            assert row.split("activations (saved)")[1].split() == " ".join(
                format_bytes(measured[rank]) for rank in range(cfg.parallel.pp)).split(), (layout, row)


def test_layer_formula_is_the_papers_form_for_this_model():
    """bf16, flash, no tp: per layer sbh (12 + 4 h_kv/h + 4 f/h) + 4asb + 8sb + 8 s head_dim
    (docs/memory.md derives it next to Korthikanti et al.'s 34 sbh + 5 a s^2 b)."""
    cfg = validate(layout_config(dtype="bf16"))
    z = Sizes.of(cfg)
    s, b, h, a, f = z.s, z.b, z.h, z.heads, z.ffn
    h_kv = z.kv_heads * z.head_dim
    want = s * b * h * 12 + 4 * s * b * h_kv + 4 * s * b * f + 4 * a * s * b + 8 * s * b + 8 * s * z.head_dim
    assert sum(layer_terms(z).values()) == want
    # tensor + sequence parallel: everything but the RoPE tables split over t, the projections'
    # inputs too (their shard kept, gathered again in backward; Korthikanti et al. 2022, sec. 4.2.2)
    tsp = Sizes.of(validate(layout_config(dtype="bf16", tp=4, sp=True)))
    t = 4
    want = (12 * s * b * h + 4 * s * b * h_kv + 4 * s * b * f + 4 * a * s * b + 8 * s * b) // t + 8 * s * z.head_dim
    assert sum(layer_terms(tsp).values()) == want


@pytest.mark.parametrize("pp,virtual,m", [(2, 2, 4), (4, 2, 8), (4, 2, 3), (2, 3, 6)])
def test_interleaved_order_runs_every_micro_batch_once_forward_then_backward(pp, virtual, m):
    for rank in range(pp):
        ops = schedule_ops("interleaved_1f1b", pp, virtual, m, rank)
        for chunk in range(virtual):
            assert [k for k, c in ops if c == chunk].count("F") == m
            alive = 0
            for kind, c in ops:
                if c == chunk:
                    alive += 1 if kind == "F" else -1
                    assert alive >= 0, (rank, chunk, ops)


@pytest.mark.parametrize("schedule,pp,m", [("zbv", 2, 4), ("dualpipev", 2, 4), ("zb1p", 2, 4), ("zbv", 4, 8)])
def test_zero_bubble_order_holds_each_micro_batch_from_its_forward_to_its_weight_step(schedule, pp, m):
    """Each local chunk runs m forwards and m W (or B) steps, never releasing a micro-batch it
    does not hold; the input steps I release nothing (trainer3d/memory/in_flight.py)."""
    for rank in range(pp):
        ops = schedule_ops(schedule, pp, 2, m, rank)
        for chunk in range(2):
            kinds = [k for k, c in ops if c == chunk]
            assert kinds.count("F") == m and kinds.count("B") == m, (rank, chunk, kinds)
            alive = 0
            for kind in kinds:
                alive += 1 if kind == "F" else -1
                assert alive >= 0, (rank, chunk, kinds)
